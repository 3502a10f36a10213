"""Runnable plans by construction: replicas never exceed the batch (the planner, plan files and the runtime read one
rule), refusals name whole nodes, devices left idle are noted with the reason."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from ppll_compile.partitioners.batch import most_replicas, split_refusal
from torch import nn

import ppll_compile
from ppll_compile import Plan, PlanError
from ppll_compile.options import PlanOptions
from ppll_compile.place.costs import Costs
from ppll_compile.place.partition import StageLayout, fewest_devices, idle_note
from ppll_compile.runtime.distributed.wire import split
from ppll_compile.runtime.messages import Message

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))


def _plan(batch: int, gpus: int, **options) -> Plan:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return ppll_compile.plan(_mlp(), gpus, example_inputs=(torch.randn(batch, 16),), profile="flops",
                                 policy="dgl", **options)


def test_the_rule_is_one_example_a_replica_at_least() -> None:
    assert [most_replicas(b) for b in (1, 2, 8)] == [1, 2, 8]
    assert split_refusal(8, 8) is None and split_refusal(3, 1) is None
    assert split_refusal(2, 3) == "a batch of 2 example(s) cannot be split over 3 replicas"


def test_the_runtime_refuses_with_the_rules_words() -> None:
    msg = Message(index=0, values=(torch.zeros(2, 4),), target=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ppll_compile.PPLLError) as e:
        split(msg, (), 2, 3)
    assert str(e.value) == f"{split_refusal(2, 3)}; feed batches of at least 3 examples"
    assert [m.size for m in split(msg, (), 2, 2)] == [1, 1]


def test_replicas_never_exceed_the_batch_and_idle_devices_are_noted() -> None:
    fast = dict(replicas=True, link_bandwidth=1e15)  # all-reduces cost nothing: every device helps, if it may
    assert [s.replicas for s in _plan(64, 16, **fast).stages] == [16]
    plan = _plan(2, 16, **fast)
    assert plan.batch_size == 2 and [s.replicas for s in plan.stages] == [2]
    idle = [n for n in plan.notes if "left idle" in n]
    expected = (r"14 of the 16 devices are left idle: the plan uses 2; its slowest stage, stage 0 \(\S+ s a step on 2 "
                r"device\(s\)\), is no faster on more: its 2 replicas train on one example each of the batch of 2 \(a "
                r"replica needs an example of its own\); plan a larger batch \(batch_size=\.\.\.\) to put more "
                r"devices to work")
    assert len(idle) == 1 and re.fullmatch(expected, idle[0]), plan.notes
    slow = _plan(64, 16, replicas=True, link_bandwidth=1.0)  # all-reduces cost hours: one device does best
    idle = [n for n in slow.notes if "left idle" in n]
    assert slow.world_size == 1 and len(idle) == 1 and idle[0].endswith(
        "is no faster on more: no layout that gives them work has a faster slowest stage (more replicas of it add "
        "more all-reduce and send time than they save)"), slow.notes


def test_every_device_working_gets_no_note() -> None:
    plan = _plan(8, 2, replicas=True, link_bandwidth=1e15)
    assert plan.world_size == 2 and not any("left idle" in n for n in plan.notes)


def test_replicas_given_by_hand_beyond_the_batch_are_refused() -> None:
    expected = ("stage 1 of replicas=[1, 3] runs on 3 replicas, but a batch of 2 example(s) cannot be split over 3 "
                "replicas (each replica trains on its own examples): give stage 1 at most 2 replicas, or plan a "
                "larger batch (batch_size=...)")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        _plan(2, None, replicas=(1, 3))
    assert [s.replicas for s in _plan(3, None, replicas=(1, 3)).stages] == [1, 3]


def test_a_plan_file_whose_replicas_exceed_its_batch_is_refused_on_load(tmp_path) -> None:
    plan = _plan(4, None, replicas=(2, 2))
    path = tmp_path / "plan.yaml"
    plan.save(path)
    assert Plan.load(path) == plan  # a runnable plan file still loads
    d = plan.to_dict()
    d["stages"][1]["replicas"] = 5
    expected = ("stage 1 runs on 5 replicas, but a batch of 4 example(s) cannot be split over 5 replicas (each "
                "replica trains on examples of its own), so the plan cannot run; set stages[1].replicas to at most "
                "4, or re-create the plan (`ppll-plan MODEL.py --yaml plan.yaml`: replicas never exceed the batch)")
    with pytest.raises(PlanError, match=f"^{re.escape(expected)}$"):
        Plan.from_dict(d)
    path.write_text(Plan.to_yaml(plan).replace("replicas: 2", "replicas: 5", 1))
    with pytest.raises(PlanError, match=re.escape(f"{path}: stage 0 runs on 5 replicas, but a batch of 4")):
        Plan.load(path)
    edited = plan.stages[0].__class__(**{**plan.stages[0].__dict__, "replicas": 5})
    with pytest.raises(PlanError, match=re.escape("stage 0 runs on 5 replicas, but a batch of 4")):
        Plan(**{**{f: getattr(plan, f) for f in plan.__dataclass_fields__}, "stages": (edited, plan.stages[1])}
             ).validate()


def _costs(memory: list[int]) -> Costs:
    n = len(memory)
    return Costs(compute=[1.0] * n, comm=[0.0] * n, memory=memory, grad_bytes=[0] * n)


def test_the_fewest_devices_that_fit_are_whole_nodes() -> None:
    # six segments of 4 bytes: 9 bytes a device fit 3 stages of 2; 5 bytes fit only 6 stages of 1
    assert fewest_devices(_costs([4] * 6), 9) == 3
    assert fewest_devices(_costs([4] * 6), 9, gpus_per_node=4) == 4  # 3 stages, replicas or idle on the 4th
    assert fewest_devices(_costs([4] * 6), 9, gpus_per_node=4, spread=False) == 4  # 4 stages of 1 or 2 segments
    assert fewest_devices(_costs([4] * 6), 5, gpus_per_node=4) == 8
    assert fewest_devices(_costs([4] * 6), 5, gpus_per_node=4, spread=False) is None  # 8 stages need 8 segments
    assert fewest_devices(_costs([4] * 6), 3) is None


@pytest.mark.parametrize("group", range(3))
def test_the_stage_counts_that_fit_are_those_the_exact_partitioner_fits(group: int) -> None:
    """Against the exact partitioner asked at every stage count, with head memory that makes a longer stage smaller."""
    import random

    from ppll_compile.partitioners import Problem, solve
    from ppll_compile.partitioners.errors import InfeasibleMemoryError
    from ppll_compile.partitioners.exact import fitting_stage_counts

    for seed in range(50 * group, 50 * group + 50):
        rng = random.Random(seed)
        n = rng.randint(1, 9)
        problem = Problem(compute=[rng.uniform(0.1, 1) for _ in range(n)], memory=[rng.randint(0, 9) for _ in range(n)],
                          head_memory=[rng.choice([0, 0, 3, 12]) for _ in range(n)],
                          start=[rng.choice([0.0, 0.05]) for _ in range(n)], memory_limit=rng.randint(6, 30))
        fits = []
        for k in range(1, n + 1):
            try:
                solve(problem, k, "exact")
            except InfeasibleMemoryError:
                continue
            fits.append(k)
        assert fitting_stage_counts(problem) == fits, f"seed {seed}: {problem}"


def test_idle_devices_beside_many_slow_stages_are_explained() -> None:
    layout = StageLayout(ends=(1, 2, 3), replicas=(1, 1, 1), speeds=(1.0,) * 3, partitioner="exact-replicas",
                         costs=(7.66, 7.6, 7.5))
    assert idle_note(layout, _costs([0] * 3), PlanOptions(), 4) == (
        "1 of the 4 devices are left idle: the plan uses 3; its slowest stage, stage 0 (7.66 s a step on 1 "
        "device(s)), is no faster on more: no layout that gives them work has a faster slowest stage (3 stages take "
        "within 5% of its time, more than the 1 idle devices could each speed up)")
    assert idle_note(layout, _costs([0] * 3), PlanOptions(), 3) is None
