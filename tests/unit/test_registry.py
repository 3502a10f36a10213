"""The runtime registry: every runtime's declared capabilities, the option errors they drive, and a runtime added by
registering one class."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ppll_compile import PPLLError
from ppll_compile.runtime import QUEUES, RUNTIMES
from ppll_compile.runtime.base import Losses, Runtime
from ppll_compile.runtime.messages import Message
from ppll_compile.runtime.registry import RUNTIME_CLASSES, register
from tests.helpers import plain_sgd, registry_pipebd, registry_ppll

pytestmark = pytest.mark.usefixtures("one_thread_quietly")


class CountingRuntime(Runtime):
    """A runtime in a few lines: every stage in order in the calling thread, counting the batches it was fed."""

    @classmethod
    def build(cls, setup: Runtime.Setup) -> CountingRuntime:
        return cls(setup.local_runners())

    def __init__(self, runners: list) -> None:
        self.runners, self.num_stages, self.fed = runners, len(runners), 0

    def step(self, msg: Message | None) -> Losses:
        assert msg is not None
        self.fed += 1
        losses: Losses = []
        for r in self.runners:
            out, loss = r.train_step(msg)
            losses.append([float(loss)])
            msg = out if out is not None else msg  # the last stage sends nothing on
        return losses

    def finish(self) -> Losses:
        return [[] for _ in self.runners]


class PickyRuntime(CountingRuntime):
    """Claims to be pipelined with two queue rules, for ``ppll`` plans only (its option errors are what is tested)."""

    modes = ("ppll",)
    queues = ("fifo", "latest")
    pipelined = True


@pytest.fixture
def toys() -> Iterator[None]:
    register("counting", CountingRuntime)
    register("picky", PickyRuntime)
    try:
        yield
    finally:
        RUNTIME_CLASSES.pop("counting")
        RUNTIME_CLASSES.pop("picky")


def test_every_runtime_declares_what_it_can_do():
    declared = {name: (c.modes, c.queues, c.pipelined, c.one_process_per_stage, c.can_move_cuts, c.whole_fit)
                for name, c in RUNTIME_CLASSES.items()}
    assert declared == {
        "sequential": (("ppll", "pipebd"), ("fifo",), False, False, True, False),
        "threads": (("ppll", "pipebd"), ("fifo", "latest", "reuse"), True, False, True, False),
        "distributed": (("ppll", "pipebd"), ("fifo", "latest", "reuse"), True, True, False, False),
        "dna": (("pipebd",), ("fifo",), False, False, False, False),
        "dna-per-block": (("pipebd",), ("fifo",), False, False, False, True),
    }
    assert RUNTIMES == ("sequential", "threads", "distributed") and QUEUES == ("fifo", "latest", "reuse")
    assert all(c.build.__func__ is not Runtime.build.__func__ for c in RUNTIME_CLASSES.values())  # each says how


def test_a_registered_runtime_trains_as_the_reference(toys):
    data = [(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i)), torch.tensor([i % 10] * 4))
            for i in range(3)]
    runs = {}
    for name in ("sequential", "counting"):
        compiled = registry_ppll()
        with compiled.trainer(optimizer=plain_sgd, runtime=name) as trainer:
            losses = [trainer.step(x, y) for x, y in data]
            assert trainer.runtime_name == name and trainer.batches == 3 and trainer.steps == {0: 3, 1: 3}
            history = trainer.fit(data[:1], progress=False)
            assert history[0]["samples"] == 4 and trainer.batches == 4
        runs[name] = (losses, [p.detach().clone() for p in compiled.model.parameters()])
    assert runs["counting"][0] == runs["sequential"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["counting"][1], runs["sequential"][1], strict=True))
    assert isinstance(trainer._runtime, CountingRuntime) and trainer._runtime.fed == 4


def test_a_registered_runtime_is_held_to_what_it_declares(toys):
    def refused(options: dict, compiled=registry_ppll) -> str:
        with pytest.raises((ValueError, PPLLError)) as info:
            compiled().trainer(optimizer=plain_sgd, **options)
        return str(info.value)

    assert refused({"runtime": "counting", "queue": "latest"}) == (
        'queue="latest" needs a pipelined runtime ("threads", "distributed" or "picky"); the counting runtime never '
        'waits')
    assert refused({"runtime": "picky", "queue": "reuse"}) == (
        'queue="reuse" needs a pipelined runtime ("threads" or "distributed"); the picky runtime runs fifo, latest '
        'queues only')
    assert refused({"runtime": "counting", "decoupled": False}) == (
        'decoupled=False (a barrier of all the stages before every optimizer step) applies to the pipelined runtimes '
        '"threads", "distributed" and "picky" with queue="fifo"')
    assert refused({"runtime": "counting", "rebalance": True}) == (
        "rebalance=True applies to the runtimes 'sequential' and 'threads', not 'counting'")
    assert refused({"runtime": "picky"}, registry_pipebd) == (
        "runtime='picky' is not known; choose one of sequential, threads, distributed, dna, dna-per-block, counting")
    picky = registry_ppll().trainer(optimizer=plain_sgd, runtime="picky", queue="latest")  # what it declares, it gets
    with picky:
        with pytest.raises(PPLLError) as info:
            picky.move_cut(0, "5")
    assert str(info.value) == ("this trainer cannot move cuts: under runtime='picky' cuts stay where they are; move "
                               "cuts under 'sequential' or 'threads', or compile again with split_points=[...]")


def test_registering_is_checked():
    with pytest.raises(TypeError, match=r"^a runtime is a subclass of ppll_compile.runtime.base.Runtime, got "):
        register("plain", object)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as info:
        register("threads", CountingRuntime)
    assert str(info.value) == ("runtime 'threads' is taken by ThreadsRuntime; register CountingRuntime under another "
                               "name")
    assert "plain" not in RUNTIME_CLASSES and RUNTIME_CLASSES["threads"].__name__ == "ThreadsRuntime"
