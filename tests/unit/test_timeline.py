"""Traced trainers record one forward, backward and step span per stage and batch, in causal order; trace files
round-trip through the Chrome trace-event format."""

import json

import pytest
import torch

import ppll_compile
from ppll_compile import PPLLError
from ppll_compile.plans.timeline import Event, Recorder, Timeline
from tests.models import Residual, conv_student, conv_teacher
from tests.helpers import plain_sgd

BATCH = 8
pytestmark = pytest.mark.usefixtures("one_thread_quietly")


def _data(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(n)]


def _traced(runtime: str, stages: int = 3, n: int = 5, **options) -> Timeline:
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Residual(), stages, example_inputs=(torch.randn(BATCH, 3, 8, 8),), policy="dgl")
    with compiled.trainer(optimizer=plain_sgd, runtime=runtime, trace=True, **options) as trainer:
        for x, y in _data(n):
            trainer.step(x, y)
        trainer.finish()
        return trainer.timeline()


def _by(timeline: Timeline, stage: int, kind: str) -> list[Event]:
    return [e for e in timeline.events if e.stage == stage and e.kind == kind]


@pytest.mark.parametrize("runtime", ["sequential", "threads"])
def test_every_stage_traces_each_batch_once_in_order(runtime):
    timeline = _traced(runtime)
    assert timeline.source == "measured" and timeline.lanes == [(0, 0), (1, 0), (2, 0)]
    assert min(e.start for e in timeline.events) == 0.0
    for j in range(3):
        spans = {kind: _by(timeline, j, kind) for kind in ("forward", "backward", "step")}
        for kind, found in spans.items():
            assert [e.batch for e in found] == list(range(5)), (j, kind)
        for f, b, s in zip(spans["forward"], spans["backward"], spans["step"]):
            assert f.start <= f.end <= b.start <= b.end <= s.start <= s.end
        for before, after in zip(spans["step"], spans["forward"][1:]):
            assert before.end <= after.start  # a stage works on one batch at a time
    if runtime == "sequential":  # stage j+1 runs batch b after stage j finished it
        for j in (0, 1):
            for s, f in zip(_by(timeline, j, "step"), _by(timeline, j + 1, "forward")):
                assert s.end <= f.start
    if runtime == "threads":  # stage j+1 runs batch b after stage j sent it (early forwarding: before its step)
        for j in (0, 1):
            for send, f in zip(_by(timeline, j, "send"), _by(timeline, j + 1, "forward")):
                assert send.start <= f.start
        assert [e.batch for e in _by(timeline, 0, "send")] == list(range(5))
        assert [e.batch for e in _by(timeline, 2, "receive")] == list(range(5))
        assert not _by(timeline, 2, "send")
        for send, receive in zip(_by(timeline, 0, "send"), _by(timeline, 1, "receive")):
            assert send.start <= receive.end
    else:
        assert not _by(timeline, 1, "receive") and not _by(timeline, 0, "send")


def test_timeline_needs_trace_true():
    compiled = ppll_compile.compile(Residual(), 2, example_inputs=(torch.randn(BATCH, 3, 8, 8),))
    trainer = compiled.trainer(optimizer=plain_sgd)
    with pytest.raises(PPLLError, match=r"^this trainer records no timeline; build it with "
                                        r"compiled.trainer\(\.\.\., trace=True\)$"):
        trainer.timeline()
    with pytest.raises(TypeError, match=r"^trace must be True or False, got 'yes'$"):
        compiled.trainer(optimizer=plain_sgd, trace="yes")


def test_untraced_trainer_records_nothing(monkeypatch):
    recorded: list[tuple[int, str, int]] = []
    add = Recorder.add

    def counted(self, kind, batch, start, end):
        recorded.append((self.stage, kind, batch))
        add(self, kind, batch, start, end)

    monkeypatch.setattr(Recorder, "add", counted)
    compiled = ppll_compile.compile(Residual(), 2, example_inputs=(torch.randn(BATCH, 3, 8, 8),))
    for trace in (False, True):
        with compiled.trainer(optimizer=plain_sgd, runtime="threads", trace=trace) as trainer:
            for x, y in _data(2):
                trainer.step(x, y)
            trainer.finish()
            if trace:  # the counting sees what a traced trainer records
                assert len(recorded) == len(trainer.timeline().events) > 0
            else:
                assert recorded == []
                with pytest.raises(PPLLError, match=r"^this trainer records no timeline"):
                    trainer.timeline()


def test_pipebd_and_dna_trace_each_block_update():
    torch.manual_seed(0)
    x = torch.randn(BATCH, 3, 16, 16)
    compiled = ppll_compile.compile(conv_student(), 2, teacher=conv_teacher(), example_inputs=(x,),
                                    split_points=["5"])
    blocks = [len(s.blocks) for s in compiled.plan.stages]
    for runtime, per_stage in (("threads", [1, 1]), ("dna", blocks)):
        with compiled.trainer(optimizer=plain_sgd, runtime=runtime, trace=True) as trainer:
            for _ in range(3):
                trainer.step(torch.randn(BATCH, 3, 16, 16))
            trainer.finish()
            timeline = trainer.timeline()
        for j, k in enumerate(per_stage):  # DNA steps every block of a stage on its own
            assert len(_by(timeline, j, "backward")) == 3 * k, runtime
            assert len(_by(timeline, j, "forward")) == 3 * k, runtime


def test_save_and_load_round_trip(tmp_path):
    timeline = _traced("threads", stages=2, n=3)
    path = timeline.save(tmp_path / "trace.json")
    data = json.loads(path.read_text())
    first = data["traceEvents"][0]
    assert first["ph"] == "X" and first["pid"] == timeline.events[0].stage and first["ts"] == 0.0
    assert data["otherData"]["runtime"] == "threads"
    back = Timeline.load(path)
    assert back.source == "measured" and back.meta == timeline.meta
    assert len(back.events) == len(timeline.events)
    for a, b in zip(back.events, timeline.events):
        assert (a.stage, a.replica, a.batch, a.kind) == (b.stage, b.replica, b.batch, b.kind)
        assert a.start == pytest.approx(b.start, abs=1e-9) and a.end == pytest.approx(b.end, abs=1e-9)


def test_load_rejects_what_is_not_a_trace(tmp_path):
    missing = tmp_path / "none.json"
    with pytest.raises(PPLLError, match=r"does not exist; write one with trainer.timeline\(\).save\(path\)$"):
        Timeline.load(missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"events": []}')
    with pytest.raises(PPLLError, match=r"bad.json: not a ppll-compile trace file \(KeyError: 'traceEvents'\)"):
        Timeline.load(bad)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"traceEvents": [{"name": "nap", "ph": "X", "ts": 0, "dur": 1, "pid": 0, "tid": 0,
                                                "args": {"batch": 0}}]}))
    with pytest.raises(PPLLError, match=r"odd.json: unknown span kind\(s\) \['nap'\]; known kinds: receive, "):
        Timeline.load(odd)
