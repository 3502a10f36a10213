"""Activation checkpointing per stage: the same training, less activation memory and more time, as the plan says."""

from __future__ import annotations

import copy

import pytest
import torch
import yaml
from torch import nn

import ppll_compile
from ppll_compile import Plan, PlanError
from ppll_compile.place.checkpointing import checkpoint_starts

pytestmark = pytest.mark.usefixtures("one_thread_quietly")  # one reduction order; no CPU-fallback warnings

X = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
CUT = "blocks.2"
ALL = [f"blocks.{i}" for i in range(5)]  # every legal cut  # stage 0: blocks 0-2 (3 segments), stage 1: blocks 3-5 and the output layer (4 segments)


class _Net(nn.Module):
    """Six blocks with dropout, each ending at a legal cut; the last one's 16 outputs are the class scores."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 16),
                                                    nn.Tanh()) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return _Net()


def _plan(**options) -> Plan:
    return ppll_compile.plan(_net(), example_inputs=(X,), profile="flops", split_points=[CUT], **options)


def _compiled(model: nn.Module, **options) -> ppll_compile.CompiledPipeline:
    torch.manual_seed(1)  # the heads' initial values
    return ppll_compile.compile(model, example_inputs=(X,), profile="flops", split_points=[CUT], **options)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _train(checkpoint: bool, seed: int = 3) -> tuple[list[torch.Tensor], int]:
    """A copy of the model trained 4 steps (dropout on): its stage parameters, and how often block 0 ran forward."""
    compiled = _compiled(_net(), checkpoint_activations=checkpoint)
    runs = []
    compiled.model.blocks[0][0].register_forward_hook(lambda *_: runs.append(1))
    g = torch.Generator().manual_seed(5)
    with compiled.trainer(optimizer=_sgd, runtime="sequential", seed=seed) as trainer:
        for _ in range(4):
            trainer.step(torch.randn(8, 16, generator=g), torch.randint(0, 16, (8,), generator=g))
    params = [p.detach().clone() for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]
    return params, len(runs)


def test_training_with_checkpointing_equals_training_without():
    plain, forwards = _train(False)
    checkpointed, recomputed = _train(True)
    assert forwards == 4 and recomputed == 8  # backward ran block 0's forward again, every step
    for p, q in zip(plain, checkpointed):
        assert torch.equal(p, q), f"differs by {float((p - q).abs().max())}"
    other, _ = _train(True, seed=4)  # the dropout masks matter: another seed trains other parameters
    assert any(not torch.equal(p, q) for p, q in zip(plain, other))


def test_lowered_stages_run_their_segments_and_equal_the_model():
    model = _net().eval()
    compiled = _compiled(model, checkpoint_activations=True)
    assert [m.checkpointed for m in compiled.lowered.modules] == [3, 3]
    assert [s.checkpoints for s in compiled.plan.stages] == [("blocks_0", "blocks_1"), ("blocks_3", "blocks_4")]
    with torch.no_grad():
        expected = model(X)
    assert torch.equal(compiled(X), expected)
    out = compiled.lowered.modules[0](X)[0]  # with gradients on: through the checkpointed segments
    assert torch.equal(out, model.blocks[:3](X))


def _segment_activations(plan_fine: Plan) -> list[int]:
    return [s.activation_bytes for s in plan_fine.stages]


def test_the_plan_prices_less_activation_memory_and_one_more_forward():
    plain, ckpt = _plan(), _plan(checkpoint_activations=True)
    fine = ppll_compile.plan(_net(), example_inputs=(X,), profile="flops", split_points=ALL)  # a stage a segment
    assert [s.last_node for s in fine.stages] == [*ckpt.stages[0].checkpoints, ckpt.cuts[0],
                                                  *ckpt.stages[1].checkpoints, "blocks_5"]
    per_segment = _segment_activations(fine)
    boundary = 8 * 16 * 4  # every segment's input: 8 x 16 float32
    assert ckpt.checkpoint_activations and not plain.checkpoint_activations
    for j, (a, b, segments) in enumerate(zip(plain.stages, ckpt.stages, (range(3), range(3, 6)))):
        largest = max(per_segment[i] for i in segments)
        assert b.kept_bytes == boundary * len(segments)
        assert b.activation_bytes == b.kept_bytes + largest < a.activation_bytes
        twice = a.head.input_saved_bytes if j == 0 else 0  # the head's input: saved by stage 0 only without it
        assert a.memory_bytes - b.memory_bytes == a.activation_bytes - b.activation_bytes - twice
        assert b.recompute_cost == pytest.approx(b.flops_fwd / ckpt.flops_per_second)
        assert b.compute_cost - a.compute_cost == pytest.approx(b.recompute_cost)
        assert b.cost > a.cost
    assert ckpt.sequential_cost - plain.sequential_cost == pytest.approx(sum(s.recompute_cost for s in ckpt.stages))
    note = next(n for n in ckpt.notes if n.startswith("activation checkpointing"))
    assert "stage 0: 3 segment(s)" in note and "stage 1: 3 segment(s)" in note
    assert not any(n.startswith("activation checkpointing") for n in plain.notes)


def _least_memory(**options) -> int:
    """The smallest per-device memory cap the partitioner finds a 2-stage layout for."""
    with pytest.raises(ppll_compile.PartitionError) as e:
        ppll_compile.plan(_net(), 2, example_inputs=(X,), profile="flops", memory_limit=1, **options)
    return int(e.value.min_limit)


def test_the_partitioner_weighs_the_smaller_memory_and_the_recompute():
    """A cap that only checkpointed stages fit: the partitioner finds them, and refuses without checkpointing."""
    plain, ckpt = _least_memory(), _least_memory(checkpoint_activations=True)
    assert ckpt < plain
    capped = ppll_compile.plan(_net(), 2, example_inputs=(X,), profile="flops", checkpoint_activations=True,
                               memory_limit=ckpt)
    assert all(s.memory_bytes <= ckpt for s in capped.stages)
    with pytest.raises(ppll_compile.PartitionError, match="no partition into 2 stages fits"):
        ppll_compile.plan(_net(), 2, example_inputs=(X,), profile="flops", memory_limit=ckpt)
    assert all(s.recompute_cost == pytest.approx(s.flops_fwd / capped.flops_per_second) for s in capped.stages)


def _saved_bytes(module: nn.Module, *inputs: torch.Tensor) -> int:
    """Bytes autograd saves in a forward of ``module`` (each storage once, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*inputs)
    del out
    return sum(saved.values())


def test_the_bytes_autograd_saves_shrink_as_the_plan_predicts():
    """Within 10% of the plan's activation bytes without checkpointing; exactly its kept bytes with it."""
    plain, ckpt = _compiled(_net()), _compiled(_net(), checkpoint_activations=True)
    for j, x in enumerate((X, torch.tanh(X))):
        a, b = plain.lowered.modules[j], ckpt.lowered.modules[j]
        full, kept = _saved_bytes(a.train(), x), _saved_bytes(b.train(), x)
        expected = plain.plan.stages[j].activation_bytes - ckpt.plan.stages[j].kept_bytes
        assert kept == ckpt.plan.stages[j].kept_bytes
        assert full == pytest.approx(plain.plan.stages[j].activation_bytes, rel=0.1)
        assert full - kept == pytest.approx(expected, rel=0.1)


def test_a_stage_without_a_cut_inside_is_one_segment_and_the_plan_says_what_it_gives():
    plan = ppll_compile.plan(_net(), example_inputs=(X,), profile="flops", split_points=ALL,
                             checkpoint_activations=True)
    s = plan.stages[1]
    assert s.checkpoints == () and s.kept_bytes == 8 * 16 * 4
    note = next(n for n in plan.notes if n.startswith("stage 1 has no legal cut inside it"))
    assert "checkpointed as one segment" in note and "its peak is its input plus all its activations" in note
    compiled = _compiled(_net(), checkpoint_activations=True)
    assert compiled.lowered.modules[0].checkpointed == 3


def test_a_plan_file_keeps_it_and_an_old_plan_file_loads(tmp_path):
    ckpt = _plan(checkpoint_activations=True)
    for suffix in ("json", "yaml"):
        assert Plan.load(ckpt.save(tmp_path / f"p.{suffix}")) == ckpt
    d = yaml.safe_load(ckpt.to_yaml())
    assert d["checkpoint_activations"] is True and d["stages"][0]["checkpoints"] == ["blocks_0", "blocks_1"]
    old = yaml.safe_load(_plan().to_yaml())  # a file from before checkpointing existed has none of its fields
    assert "checkpoint_activations" not in old and "kept_bytes" not in old["stages"][0]
    loaded = Plan.from_dict(old)
    assert not loaded.checkpoint_activations and loaded.stages[0].checkpoints == ()
    made = ppll_compile.plan(_net(), 2, example_inputs=(X,), profile="flops", checkpoint_activations=True)
    again = ppll_compile.plan(_net(), example_inputs=(X,), profile="flops", plan=made.save(tmp_path / "re.yaml"))
    assert again.checkpoint_activations and again.stages[0].checkpoints == made.stages[0].checkpoints  # re-applied


def test_a_hand_edited_plan_file_is_checked(tmp_path):
    d = yaml.safe_load(_plan(checkpoint_activations=True).to_yaml())
    bad = copy.deepcopy(d)
    bad["stages"][0]["checkpoints"] = ["blocks_3"]
    with pytest.raises(PlanError, match=r"stage 0: checkpoints \['blocks_3'\] are not legal cuts inside the stage; "
                                        r"its segments may end at \['blocks_0', 'blocks_1'\]"):
        Plan.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["stages"][0]["checkpoints"] = ["blocks_1", "blocks_0"]
    with pytest.raises(PlanError, match="not in graph order"):
        Plan.from_dict(bad)
    bad = copy.deepcopy(d)
    bad["checkpoint_activations"] = False
    with pytest.raises(PlanError, match="set checkpoint_activations: true, or delete them"):
        Plan.from_dict(bad)
    bad["checkpoint_activations"] = "yes"
    with pytest.raises(PlanError, match="checkpoint_activations must be true or false, got 'yes'"):
        Plan.from_dict(bad)


def _brute_force(held: list[int], read: list[int]) -> int:
    """The least kept + largest over every way to merge the atomic segments."""
    n, best = len(held), None
    for mask in range(2 ** (n - 1)):
        starts = [0] + [i for i in range(1, n) if mask >> (i - 1) & 1]
        ends = [*starts[1:], n]
        cost = sum(read[b] for b in starts) + max(sum(held[b:e]) for b, e in zip(starts, ends))
        best = cost if best is None else min(best, cost)
    return best


def test_the_segments_merge_as_brute_force_finds_least():
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        n = int(torch.randint(1, 9, (1,), generator=g))
        held = torch.randint(0, 100, (n,), generator=g).tolist()
        read = torch.randint(0, 60, (n,), generator=g).tolist()
        starts = checkpoint_starts(held, read)
        ends = [*starts[1:], n]
        cost = sum(read[b] for b in starts) + max(sum(held[b:e]) for b, e in zip(starts, ends))
        assert starts[0] == 0 and starts == sorted(set(starts)) and cost == _brute_force(held, read)
    # past the exact size, geometric caps: never more than checkpointing every atomic segment alone
    held, read = [100] * 200, [10] * 200
    starts = checkpoint_starts(held, read)
    assert 10 * len(starts) + 100 * max(b - a for a, b in zip(starts, [*starts[1:], 200])) < 10 * 200 + 100


def test_a_distillation_plan_refuses_it():
    from models import conv_student, conv_teacher
    with pytest.raises(ValueError, match=r"checkpoint_activations=True recomputes a ppll stage's forward in its "
                                         r"backward; a pipebd plan does not support it: drop checkpoint_activations="):
        ppll_compile.plan(conv_student(), 2, teacher=conv_teacher(), example_inputs=(torch.randn(4, 3, 32, 32),),
                          profile="flops", checkpoint_activations=True)


def test_batch_norm_statistics_are_updated_once_per_step_as_without_checkpointing():
    """The recompute runs every batch norm's forward again; its running statistics must not count that batch twice
    (the kernels update them in place without counting it as a change, so every buffer gets its value back)."""
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU()) for _ in range(6)],
                             nn.Linear(16, 4))

    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    states = []
    for ckpt in (False, True):
        model = net()
        compiled = ppll_compile.compile(model, example_inputs=(x,), profile="flops", split_points=["2"],
                                        devices=["cpu", "cpu"], checkpoint_activations=ckpt)
        assert [len(s.checkpoints) for s in compiled.plan.stages] == ([2, 2] if ckpt else [0, 0])
        with compiled.trainer(optimizer=lambda params: torch.optim.SGD(params, lr=0.1)) as trainer:
            for _ in range(3):
                trainer.step(x, y)
            trainer.finish()
        states.append(model.state_dict())
    plain, ours = states
    assert int(ours["0.1.num_batches_tracked"]) == 3
    assert all(torch.equal(ours[k], v) for k, v in plain.items()), [k for k, v in plain.items()
                                                                   if not torch.equal(ours[k], v)]
