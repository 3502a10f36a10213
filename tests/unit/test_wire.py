"""The distributed runtime's wire format in one process: every message kind packs and receives back exactly (the
receive buffers sized from the plan alone), the header's fields, cutting by rows for replicas, and the errors."""

from __future__ import annotations

import json
from collections import defaultdict, deque
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from ppll_compile.errors import PPLLError
from ppll_compile.plans.plan import TensorSpec
from ppll_compile.runtime.distributed.wire import END, Stop, Wire, check_splittable, join, split
from ppll_compile.runtime.messages import EVAL, TRAIN, Message

PLANNED = 4  # the planned batch size: a dimension 0 of 4 in a spec is the batch

H = TensorSpec(name="h", shape=(PLANNED, 6), dtype="float32", bytes=96)
FIXED = TensorSpec(name="table", shape=(2, 3), dtype="float64", bytes=48)  # dimension 0 is not the batch
COUNT = TensorSpec(name="count", shape=(), dtype="int", bytes=0)
SCALE = TensorSpec(name="scale", shape=(), dtype="float", bytes=0)
FLAG = TensorSpec(name="flag", shape=(), dtype="bool", bytes=0)
SPECS = (H, FIXED, COUNT, SCALE, FLAG)
RAW = TensorSpec(name="x", shape=(PLANNED, 3, 2, 2), dtype="float32", bytes=192)


def _wire(specs: tuple[TensorSpec, ...] = SPECS, stage: int = 1) -> Wire:
    return Wire(stage=stage, planned=PLANNED, in_specs=specs, raw_spec=RAW, comm=torch.device("cpu"))


def _message(batch: int = 3, index: int = 5, raw: bool = True, target: torch.Tensor | None = None,
             kind: str = TRAIN) -> Message:
    g = torch.Generator().manual_seed(index)
    values = (torch.randn(batch, 6, generator=g), torch.randn(2, 3, dtype=torch.float64, generator=g), 7, 0.25, True)
    return Message(index=index, values=values, kind=kind,
                   target=torch.randint(0, 5, (batch,), generator=g) if target is None else target,
                   raw=torch.randn(batch, 3, 2, 2, generator=g) if raw else None)


class Link:
    """In place of ``dist.recv``: hands each receive the next tensor a rank sent, into a buffer that must have the
    tensor's exact shape and dtype (the receiver sizes its buffers from the plan and the header alone)."""

    def __init__(self) -> None:
        self.sent: dict[int, deque[torch.Tensor]] = defaultdict(deque)

    def send(self, src: int, tensors: list[torch.Tensor]) -> None:
        self.sent[src].extend(t.clone() for t in tensors)

    def recv(self, buf: torch.Tensor, src: int) -> None:
        t = self.sent[src].popleft()
        assert (buf.shape, buf.dtype) == (t.shape, t.dtype), f"buffer {buf.shape} {buf.dtype} for {t.shape} {t.dtype}"
        buf.copy_(t)

    def left(self) -> int:
        return sum(len(q) for q in self.sent.values())


@pytest.fixture
def link(monkeypatch) -> Link:
    fake = Link()
    monkeypatch.setattr(dist, "recv", fake.recv)
    return fake


def _assert_same(got: Message, sent: Message, whole: int | None = None) -> None:
    assert (got.index, got.kind, got.whole) == (sent.index, sent.kind, whole)
    assert len(got.values) == len(sent.values)
    for a, b in zip(got.values, sent.values):
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b)
        else:
            assert type(a) is type(b) and a == b
    assert got.target.dtype == sent.target.dtype and torch.equal(got.target, sent.target)
    assert (got.raw is None) == (sent.raw is None)
    if sent.raw is not None:
        assert torch.equal(got.raw, sent.raw)


# ---- round trips -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", [TRAIN, EVAL])
@pytest.mark.parametrize("batch", [PLANNED, 1, 3])
def test_a_batch_comes_back_exactly_with_its_python_scalars_and_raw_input(link, kind, batch):
    sent = _message(batch=batch, kind=kind)
    link.send(0, _wire(stage=0).pack(sent, kind, SPECS))
    got = _wire().receive([0])
    _assert_same(got, sent)
    assert link.left() == 0


@pytest.mark.parametrize("target", [torch.zeros(3, 2, 5, dtype=torch.float16), torch.ones(3, dtype=torch.bool),
                                    torch.arange(3 * 2 ** 7).reshape(3, *[2] * 7).to(torch.int8),
                                    torch.full((3,), 2.5, dtype=torch.bfloat16)],
                         ids=["float16-3d", "bool", "int8-8d", "bfloat16"])
def test_targets_of_any_listed_dtype_and_up_to_8_dimensions_come_back(link, target):
    sent = _message(raw=False, target=target)
    link.send(0, _wire(stage=0).pack(sent, TRAIN, SPECS))
    _assert_same(_wire().receive([0]), sent)


def test_the_header_names_kind_index_batch_target_and_raw(link):
    tensors = _wire(stage=0).pack(_message(batch=3, index=9, target=torch.zeros(3, 2, dtype=torch.float32)),
                                  EVAL, SPECS)
    header = tensors[0]
    assert header.dtype == torch.int64 and header.tolist() == [2, 9, 3, 8, 2, 1, 0, 0, 3, 2, 0, 0, 0, 0, 0, 0]
    # then the values (a scalar as a one-element tensor: int64 for int and bool, float64 for float), target, raw
    assert [(tuple(t.shape), t.dtype) for t in tensors[1:]] == [
        ((3, 6), torch.float32), ((2, 3), torch.float64), ((1,), torch.int64), ((1,), torch.float64),
        ((1,), torch.int64), ((3, 2), torch.float32), ((3, 3, 2, 2), torch.float32)]
    assert all(t.is_contiguous() for t in tensors)


def test_end_and_stop_come_back_as_end_and_the_report(link):
    report = {"stage": 2, "batch": 7, "by": 2, "rank": 3, "message": "ValueError: naïve ✗", "traceback": "T"}
    wire = _wire(stage=0)
    end, stop = wire.end(), wire.stop(report)
    assert [t.tolist() for t in end] == [[3] + [0] * 15]
    assert stop[0].tolist() == [4, 0, 0, 0, 0, 0, len(json.dumps(report).encode()), 0] + [0] * 8
    assert stop[1].dtype == torch.uint8 and bytes(stop[1].tolist()) == json.dumps(report).encode()
    link.send(0, end)
    link.send(0, stop)
    receiver = _wire()
    assert receiver.receive([0]) is END
    got = receiver.receive([0])
    assert isinstance(got, Stop) and got.report == report
    assert link.left() == 0


def test_an_end_from_every_replica_is_end_and_a_stop_from_any_stops(link):
    wire = _wire(stage=0)
    link.send(1, wire.end())
    link.send(2, wire.end())
    receiver = _wire()
    assert receiver.receive([1, 2]) is END
    link.send(1, wire.stop({"stage": 0, "message": "m"}))
    got = receiver.receive([1, 2])
    assert isinstance(got, Stop) and got.report == {"stage": 0, "message": "m"} and receiver.receiving_from == 1


# ---- replicas: cut by rows, joined back ------------------------------------------------------------------------

def test_split_cuts_the_batch_rows_near_equally_and_join_puts_them_back():
    sent = _message(batch=7, raw=True)
    parts = split(sent, SPECS, PLANNED, 3)
    assert [p.size for p in parts] == [3, 2, 2] and {p.whole for p in parts} == {7} and {p.index for p in parts} == {5}
    assert [tuple(p.values[0].shape) for p in parts] == [(3, 6), (2, 6), (2, 6)]
    for p in parts:  # values that are not the batch go whole to each
        assert p.values[1] is sent.values[1] and p.values[2:] == (7, 0.25, True)
    assert torch.equal(join([p.values[0] for p in parts], H, PLANNED), sent.values[0])
    assert join([p.values[1] for p in parts], FIXED, PLANNED) is sent.values[1]
    assert torch.equal(torch.cat([p.raw for p in parts]), sent.raw)
    assert split(sent, SPECS, PLANNED, 1) == [sent]


def test_parts_sent_by_replicas_are_received_as_the_whole_batch(link):
    sent = _message(batch=7)
    sender = _wire(stage=0)
    for rank, part in zip((1, 2), split(sent, SPECS, PLANNED, 2)):
        link.send(rank, sender.pack(part, TRAIN, SPECS))
    got = _wire().receive([1, 2])
    _assert_same(got, sent, whole=7)
    assert link.left() == 0


def test_a_replica_slice_received_alone_keeps_the_whole_batch_size(link):
    part = split(_message(batch=7), SPECS, PLANNED, 2)[1]
    link.send(0, _wire(stage=0).pack(part, TRAIN, SPECS))
    got = _wire().receive([0])
    assert got.whole == 7 and got.size == 3


# ---- errors -----------------------------------------------------------------------------------------------------

def test_a_value_count_other_than_the_plans_is_refused():
    with pytest.raises(PPLLError) as e:
        _wire(stage=0).pack(_message(), TRAIN, SPECS[:2])
    assert str(e.value) == "stage 0 produced 5 boundary value(s); the plan has 2"


def test_a_value_of_another_shape_or_dtype_is_named_with_what_the_plan_fixes():
    msg = _message(batch=3)
    msg.values = (torch.zeros(3, 5), *msg.values[1:])
    with pytest.raises(PPLLError) as e:
        _wire(stage=0).pack(msg, TRAIN, SPECS)
    assert str(e.value) == (
        "stage 0 sends boundary value 'h' with shape (3, 5) float32; the plan fixes (3, 6) float32 for a batch of 3. "
        "The distributed runtime sizes its receive buffers from the plan, where only a dimension 0 equal to the "
        "planned batch size (4) may vary: compile with example inputs shaped like your batches")
    msg.values = (torch.zeros(3, 6, dtype=torch.float64), *msg.values[1:])
    with pytest.raises(PPLLError, match=r"with shape \(3, 6\) float64; the plan fixes \(3, 6\) float32"):
        _wire(stage=0).pack(msg, TRAIN, SPECS)


def test_a_raw_input_of_another_shape_is_named():
    msg = _message(batch=3)
    msg.raw = torch.zeros(3, 3, 4, 4)
    with pytest.raises(PPLLError, match=r"^stage 2 sends the raw input with shape \(3, 3, 4, 4\) float32; the plan "
                                        r"fixes \(3, 3, 2, 2\) float32 for a batch of 3\. "):
        _wire(stage=2).pack(msg, TRAIN, SPECS)


@pytest.mark.parametrize("value,found", [("seven", "str"), (torch.tensor(7), "Tensor"), (None, "NoneType")])
def test_only_int_float_and_bool_scalars_travel_beside_tensors(value, found):
    msg = _message()
    msg.values = (msg.values[0], msg.values[1], value, *msg.values[3:])
    with pytest.raises(PPLLError) as e:
        _wire(stage=1).pack(msg, TRAIN, SPECS)
    assert str(e.value) == (
        f"stage 1 sends 'count' as {found}; the plan recorded a Python int there when the model was captured, so "
        f"the model computes another kind of value now than it did when it was compiled: compile again with example "
        f"inputs like the batches you train on, or cut elsewhere (split_points=...)")


MASK = TensorSpec(name="expand_2", shape=(PLANNED, 1, 5, 5), dtype="bool", bytes=PLANNED * 25, scalar=False)
POSITIONS = TensorSpec(name="positions", shape=(1, 5), dtype="int64", bytes=40)
ROTARY = TensorSpec(name="freqs_cis", shape=(5, 2), dtype="complex64", bytes=80)
ZERO_D = TensorSpec(name="flag", shape=(), dtype="bool", bytes=1)  # a 0-d bool tensor: 1 byte, not a Python bool


def test_side_tensors_of_every_dtype_travel_as_tensors(link):
    """A causal LM's boolean mask, integer positions and a complex rotary table come back as the tensors sent."""
    specs = (H, MASK, POSITIONS, ROTARY, ZERO_D)
    g = torch.Generator().manual_seed(0)
    values = (torch.randn(3, 6, generator=g), torch.rand(3, 1, 5, 5, generator=g) > 0.5, torch.arange(5)[None],
              torch.randn(5, 2, dtype=torch.complex64, generator=g), torch.tensor(True))
    sent = Message(index=1, values=values, kind=TRAIN, target=torch.zeros(3, dtype=torch.long), raw=None)
    link.send(0, _wire(specs, stage=0).pack(sent, TRAIN, specs))
    _assert_same(_wire(specs).receive([0]), sent)
    assert [s.scalar for s in specs] == [False] * 5 and all(s.scalar for s in (COUNT, SCALE, FLAG))


def test_the_kind_of_a_side_value_is_recorded_from_the_captured_graph_and_kept_by_plan_files():
    from ppll_compile.cost.nodes import tensor_spec
    mask, flag = tensor_spec("mask", torch.ones(2, 3, dtype=torch.bool)), tensor_spec("flag", True)
    assert (mask.scalar, mask.dtype, flag.scalar, flag.dtype) == (False, "bool", True, "bool")
    assert [TensorSpec.from_dict(s.to_dict()) for s in (mask, flag, ZERO_D)] == [mask, flag, ZERO_D]
    old_file = {"name": "flag", "shape": [], "dtype": "bool", "bytes": 0}  # written before the kind was recorded
    assert TensorSpec.from_dict(old_file).scalar and not TensorSpec.from_dict(MASK.to_dict()).scalar
    with pytest.raises(ValueError, match=r"^boundary value 'm' is marked a Python scalar but has dtype 'bool', "
                                         r"shape \[2\] and 2 bytes; a Python scalar has a dtype of int, float, bool, "
                                         r"no shape and 0 bytes$"):
        TensorSpec(name="m", shape=(2,), dtype="bool", bytes=2, scalar=True)


def test_a_target_that_is_not_one_tensor_is_refused_with_the_way_out():
    with pytest.raises(PPLLError) as e:
        _wire(stage=0).pack(_message(target=[1, 2, 3]), TRAIN, SPECS)
    assert str(e.value) == ("the distributed runtime sends the labels between processes as one tensor; got list. "
                            "Pass the target as a tensor (or use runtime=\"threads\")")


@pytest.mark.parametrize("target,text", [(torch.zeros([1] * 9), "(1, 1, 1, 1, 1, 1, 1, 1, 1) and dtype torch.float32"),
                                         (torch.zeros(3, dtype=torch.complex64), "(3) and dtype torch.complex64")])
def test_a_target_of_more_than_8_dimensions_or_an_unlisted_dtype_is_refused(target, text):
    with pytest.raises(PPLLError) as e:
        _wire(stage=0).pack(_message(target=target), TRAIN, SPECS)
    assert str(e.value) == (
        f"the target has shape {text}; the distributed runtime sends targets of at most 8 dimensions and dtypes "
        f"bool, uint8, int8, int16, int32, int64, float16, bfloat16, float32, float64; convert it first")


def test_a_header_of_unknown_kind_is_named_with_its_sender(link):
    link.send(3, [torch.tensor([9] + [0] * 15)])
    with pytest.raises(PPLLError) as e:
        _wire(stage=2).receive([3])
    assert str(e.value) == "stage 2 received a header of unknown kind 9 from rank 3"


def test_end_from_some_replicas_and_a_batch_from_others_is_refused(link):
    sender = _wire(stage=1)
    link.send(1, sender.pack(_message(), TRAIN, SPECS))
    link.send(2, sender.end())
    with pytest.raises(PPLLError) as e:
        _wire(stage=2).receive([1, 2])
    assert str(e.value) == "stage 2 received END from some replicas of stage 1 and a batch from others"


def test_a_batch_smaller_than_the_replicas_cannot_be_split():
    with pytest.raises(PPLLError) as e:
        split(_message(batch=2), SPECS, PLANNED, 3)
    assert str(e.value) == ("a batch of 2 example(s) cannot be split over 3 replicas; feed batches of at least 3 "
                            "examples")


def _plan(replicas: list[int], boundaries: list[tuple[TensorSpec, ...]]) -> SimpleNamespace:
    stages = [SimpleNamespace(replicas=r, boundary=b) for r, b in zip(replicas, boundaries)]
    return SimpleNamespace(num_stages=len(stages), stages=stages, inputs=(RAW,))


def test_a_replicated_stage_cannot_take_or_follow_a_python_scalar():
    check_splittable(_plan([1, 1, 1], [(COUNT,), (COUNT,), ()]))  # nothing replicated: scalars may travel
    check_splittable(_plan([2, 1, 1], [(H,), (COUNT,), ()]))  # stage 1 follows a replicated stage, gets tensors
    with pytest.raises(PPLLError) as e:
        check_splittable(_plan([1, 1, 2], [(H,), (H, COUNT), ()]))
    assert str(e.value) == ("stage 2 is replicated (or follows a replicated stage), but its input carries a Python "
                            "scalar, which cannot be split by rows; compile with replicas=False or cut elsewhere")
    with pytest.raises(PPLLError, match=r"^stage 1 is replicated \(or follows a replicated stage\)"):
        check_splittable(_plan([2, 1, 1], [(H, SCALE), (H,), ()]))
