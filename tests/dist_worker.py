"""Workers of the distributed-runtime tests: ``python tests/dist_worker.py K PORT TIMEOUT SCENARIO OUT [ARG]``."""

# The tests import the same functions to run the sequential reference in-process, so both sides build the
# same model from the same seed and train it on the same batches.

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from models import Residual, conv_student, conv_teacher  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import seeded_batches, sgd  # noqa: E402

__all__ = ["Trap", "Chain", "SizedResidual", "fifo_pipeline", "fifo_program", "fifo_fit", "chain_pipeline",
           "stage_states", "distill_pipeline", "distill_program", "replicated_chain", "gated_sgd", "main", "launch", "accumulate_pipeline", "accumulate_program"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()


class Trap(nn.Module):
    """Identity that misbehaves once armed: raises, returns NaN or kills its process at call ``at``, or sleeps."""

    def __init__(self, mode: str, at: float) -> None:
        super().__init__()
        self.mode, self.at = mode, at
        self.armed = False  # compile() runs the module while planning
        self.calls = 0
        self.fired: float | None = None
        """When it raised (``time.time()``), if it has."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        n, self.calls = self.calls, self.calls + 1
        if self.mode == "sleep":
            time.sleep(self.at)
        elif n == self.at:
            if self.mode == "raise":
                self.fired = time.time()
                raise RuntimeError(f"boom at call {n}")
            if self.mode == "nan":
                return x * float("nan")
            if self.mode == "exit":
                os._exit(17)
        return x


class Chain(nn.Module):
    """``stages`` blocks of linear + ReLU, the trap at the end of block ``trap_stage``, then a classifier."""

    def __init__(self, stages: int, trap: Trap | None = None, trap_stage: int = 0) -> None:
        super().__init__()
        blocks = []
        for i in range(stages):
            layers: list[nn.Module] = [nn.Linear(8, 8), nn.ReLU()]
            if trap is not None and i == trap_stage:
                layers.append(trap)
            blocks.append(nn.Sequential(*layers))
        self.blocks = nn.Sequential(*blocks)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


# ---- FIFO equality, fit/evaluate, checkpoints --------------------------------------------------------

class SizedResidual(Residual):
    """Residual whose output is reshaped by the batch size read off the input: a Python int crosses every cut."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        return super().forward(x).reshape(n, -1)


def fifo_pipeline(k: int, runtime: str) -> Any:
    """SizedResidual in ``k`` stages; 3 stages cut at two feature maps with InfoPro heads (the raw input travels)."""
    torch.manual_seed(0)
    model = SizedResidual()
    x = torch.randn(8, 3, 8, 8)
    if k == 3:
        compiled = ppll_compile.compile(model, example_inputs=(x,), split_points=["relu", "add"], policy="infopro")
    else:
        compiled = ppll_compile.compile(model, example_inputs=(x,), split_points=["add"], policy="dgl")
    return compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60)


def stage_states(trainer: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Block and head tensors (parameters and buffers) of every stage this process trains."""
    c, plan = trainer.lowered, trainer.plan
    out = {}
    if plan.mode == "pipebd":
        for i in trainer.stages:
            out[i] = {f"block{k}.{n}": v.detach().cpu().clone() for k in plan.stages[i].blocks
                      for n, v in c.modules[k].state_dict().items()}
        return out
    for i in trainer.stages:
        head = c.heads[i]
        out[i] = {f"block.{k}": v.detach().cpu().clone() for k, v in c.modules[i].state_dict().items()} | \
                 ({f"head.{k}": v.detach().cpu().clone() for k, v in head.state_dict().items()} if head else {})
    return out


STEP_SIZES = [8, 8, 8, 8, 5]  # the last batch is smaller
FIT_SIZES = [8, 8, 6]


def fifo_program(trainer: Any, out: Path, load: str | None = None) -> dict[str, Any]:
    """steps (a smaller last batch) -> finish -> save to ``out/ckpt`` -> :func:`fifo_fit`; states along the way."""
    for x, y in seeded_batches(1, STEP_SIZES, (3, 8, 8), 5):
        trainer.step(x, y)
    trainer.finish()
    after_steps = stage_states(trainer)
    trainer.save(out / "ckpt")
    return {"after_steps": after_steps} | fifo_fit(trainer, load)


def fifo_fit(trainer: Any, load: str | Path | None = None) -> dict[str, Any]:
    """[load a checkpoint] -> fit 2 epochs -> evaluate; the losses, accuracies and final states."""
    if load is not None:
        trainer.load(load)
    history = trainer.fit(seeded_batches(2, FIT_SIZES, (3, 8, 8), 5), epochs=2, progress=False)
    return {"history": [h["loss"] for h in history], "samples": [h["samples"] for h in history],
            "accuracy": trainer.evaluate(seeded_batches(3, [8, 7], (3, 8, 8), 5)), "final": stage_states(trainer),
            "steps": trainer.steps, "batches": trainer.batches}


# ---- Pipe-BD, replicated stages, the DNA baseline ----------------------------------------------------------

DISTILL_LAYOUTS = {"two": (["5"], (1, 1)), "replicated": (["5"], (2, 1)), "one": (None, (1,))}
"""Stage ends (student block ends) and replicas per stage of the distillation scenarios."""


def distill_pipeline(runtime: str, layout: str, **options: Any) -> Any:
    """The small CNN student distilled from the CNN teacher (4 aligned blocks), in ``layout``."""
    torch.manual_seed(0)
    teacher, student = conv_teacher(), conv_student()
    split, replicas = DISTILL_LAYOUTS[layout]
    compiled = ppll_compile.compile(student, teacher=teacher, example_inputs=(torch.randn(8, 3, 16, 16),),
                                    split_points=split, replicas=replicas)
    return compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60, **options)


def distill_program(trainer: Any, out: Path) -> dict[str, Any]:
    """steps without labels (a smaller last batch) -> save -> fit 2 epochs -> evaluate; states along the way."""
    for (x, _) in seeded_batches(1, STEP_SIZES, (3, 16, 16), 10):
        trainer.step(x)
    trainer.finish()
    after_steps = stage_states(trainer)
    trainer.save(out / "ckpt")
    history = trainer.fit(seeded_batches(2, FIT_SIZES, (3, 16, 16), 10), epochs=2, progress=False)
    return {"after_steps": after_steps, "final": stage_states(trainer), "history": [h["loss"] for h in history],
            "evaluation": trainer.evaluate(seeded_batches(3, [8, 7], (3, 16, 16), 10))}


def replicated_chain(runtime: str) -> Any:
    """A 2-stage chain whose second stage runs on two replicas (traced)."""
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Chain(2), example_inputs=(torch.randn(8, 8),), policy="dgl",
                                    split_points=["blocks.0"], replicas=(1, 2))
    return compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60, trace=True)


def replicated_program(trainer: Any) -> dict[str, Any]:
    for x, y in seeded_batches(7, [8, 8, 8, 5], (8,), 4):
        trainer.step(x, y)
    trainer.finish()
    history = trainer.fit(seeded_batches(8, [8, 6], (8,), 4), epochs=1, progress=False)
    return {"final": stage_states(trainer), "accuracy": trainer.evaluate(seeded_batches(9, [8, 7], (8,), 4)),
            "samples": [h["samples"] for h in history],
            "timeline": [(e.stage, e.replica, e.batch, e.kind, e.start, e.end) for e in trainer.timeline().events]}


# ---- faults, queues, early forwarding ----------------------------------------------------------------------

def chain_pipeline(k: int, runtime: str, trap: Trap | None, trap_stage: int, **options: Any) -> Any:
    torch.manual_seed(0)
    model = Chain(k, trap, trap_stage)
    compiled = ppll_compile.compile(model, example_inputs=(torch.randn(8, 8),), policy="dgl",
                                    split_points=[f"blocks.{i}" for i in range(k - 1)], leaf_modules=(Trap,))
    if trap is not None:
        trap.armed = True
    return compiled.trainer(**{"optimizer": sgd, "runtime": runtime, "timeout": 60, **options})


def _fault(out: Path, k: int, mode: str, trap_stage: int, **options: Any) -> None:
    rank = int(os.environ["RANK"])
    trainer = chain_pipeline(k, "distributed", Trap(mode, 3 if mode != "nan" else 2), trap_stage, **options)
    try:
        with trainer:
            trainer.fit(seeded_batches(4, [8] * 12, (8,), 4), epochs=1, progress=False)
        text, kind = "no error", None
    except Exception as e:  # noqa: BLE001 - reported to the test
        text, kind = str(e), type(e).__name__
    (out / f"error-{rank}.json").write_text(json.dumps({"text": text, "type": kind, "time": time.time()}))
    sys.exit(1 if kind else 0)


def _stay(out: Path, replicated: bool) -> None:
    """The last rank raises at batch 3 and waits in its handler, before it closes, until every other rank has reported.

    Unreplicated: 3 stages, the last fails. Replicated: stage 1 runs on ranks 1 and 2, and only rank 2 fails.
    Each rank writes its error, when it raised, when its ``close()`` began and ended, and whether the process
    group is still initialised.
    """
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    failing = world - 1
    others = [out / f"error-{r}.json" for r in range(world) if r != failing]
    trap = Trap("raise", 3)
    torch.manual_seed(0)
    stages = 2 if replicated else 3
    compiled = ppll_compile.compile(Chain(stages, trap, stages - 1), example_inputs=(torch.randn(8, 8),),
                                    policy="dgl", split_points=[f"blocks.{i}" for i in range(stages - 1)],
                                    leaf_modules=(Trap,), replicas=(1, 2) if replicated else False)
    trap.armed = rank == failing
    trainer = compiled.trainer(optimizer=sgd, runtime="distributed", timeout=120)
    error: Exception | None = None
    raised = closing = None
    try:
        with trainer:
            try:
                trainer.fit(seeded_batches(4, [8] * 40, (8,), 4), epochs=1, progress=False)
            except Exception as e:
                error, raised = e, time.time()
                if rank == failing:  # like a script that logs the error, or sits in a debugger, before it closes
                    deadline = time.monotonic() + 60
                    while not all(f.exists() for f in others) and time.monotonic() < deadline:
                        time.sleep(0.1)
                closing = time.time()
                raise
    except Exception:  # noqa: BLE001 - reported to the test
        pass
    record = {"type": type(error).__name__ if error else None, "text": str(error) if error else "no error",
              "fired": trap.fired, "raised": raised, "closing": closing, "closed": time.time(),
              "initialized": dist.is_initialized(), "others_reported": all(f.exists() for f in others)}
    (out / f"error-{rank}.json").write_text(json.dumps(record))


def _reuse(out: Path) -> None:
    rank = int(os.environ["RANK"])
    trainer = chain_pipeline(3, "distributed", Trap("sleep", 0.03), 0, queue="reuse")
    with trainer:
        history = trainer.fit(seeded_batches(5, [8] * 9 + [5], (8,), 4), epochs=2, progress=False)
        accuracy = trainer.evaluate(seeded_batches(6, [8, 8], (8,), 4))
    (out / f"reuse-{rank}.json").write_text(json.dumps({"steps": trainer.steps, "reused": trainer.reused,
                                                        "loss": [h["loss"] for h in history],
                                                        "accuracy": accuracy}))


def _wait_for(path: Path, what: str) -> None:
    deadline = time.monotonic() + 20
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.01)


def gated_sgd(trainer_stage: int, gate: Callable[[], None]) -> Callable[[list[nn.Parameter]], Any]:
    """An SGD factory whose optimizer calls ``gate()`` before every step (in the process of ``trainer_stage``)."""
    rank = int(os.environ.get("RANK", "0"))

    class Gated(torch.optim.SGD):
        def step(self, closure: Any = None) -> Any:
            if rank == trainer_stage:
                gate()
            return super().step(closure)

    return lambda params: Gated(params, lr=0.05, momentum=0.9)


def _newest(out: Path) -> None:
    """queue="latest", 2 ranks: stage 1's first step waits until rank 0 fed all 8 batches and finished the epoch
    (it never waits for room), then stage 1 trains on the newest, batch 7, and drops 1 .. 6."""
    rank = int(os.environ["RANK"])
    fed = out / "fed"
    trainer = chain_pipeline(2, "distributed", None, 0, queue="latest", queue_depth=1, trace=True,
                             optimizer=gated_sgd(1, lambda: _wait_for(fed, "rank 0 never fed every batch")))
    with trainer:
        if rank == 0:
            for x, y in seeded_batches(7, [8] * 8, (8,), 4):
                trainer.step(x, y)
        trainer.finish()  # rank 0: every batch and the end of the epoch sent, and taken by rank 1's inbox
        if rank == 0:
            fed.touch()
        torch.save({"trained": [e.batch for r in trainer.runners for e in r.recorder.events if e.kind == "forward"],
                    "steps": trainer.steps, "dropped": trainer.dropped, "states": stage_states(trainer)},
                   out / f"newest-{rank}.pt")


def _early(out: Path) -> None:
    """FIFO, 2 ranks: stage 0's first optimizer step waits until stage 1 began its forward on batch 0."""
    rank = int(os.environ["RANK"])
    begun = out / "begun"
    trainer = chain_pipeline(2, "distributed", None, 0,
                             optimizer=gated_sgd(0, lambda: _wait_for(begun, "stage 1 never received batch 0")))
    if rank == 1:
        trainer.lowered.modules[1].register_forward_pre_hook(lambda *_: begun.touch())
    with trainer:
        trainer.fit(seeded_batches(8, [8] * 3, (8,), 4), epochs=1, progress=False)
    (out / f"early-{rank}.json").write_text(json.dumps({"steps": trainer.steps}))


def _momentum(out: Path) -> None:
    """A momentum head (m = 0, every step) on stage 0 over 2 epochs with an evaluation between them: rank 1
    records every copy of the weights it publishes, rank 0 the trunk it ends with and how many copies it took."""
    from tests.helpers import momentum_pipeline, recording_sgd

    rank = int(os.environ["RANK"])
    compiled = momentum_pipeline(0.0, 1)
    snapshots: list[Any] = []
    with compiled.trainer(optimizer=recording_sgd(compiled, snapshots), runtime="distributed", timeout=60) as trainer:
        data = seeded_batches(3, [4] * 6, (3, 8, 8), 5)
        trainer.fit(data, epochs=1, progress=False)
        trainer.evaluate(data[:2])
        trainer.fit(data, epochs=2, progress=False)
    record = {"snapshots": snapshots} if rank == 1 else {"trunk": compiled.lowered.heads[0].ema_tensors()}
    torch.save(record, out / f"momentum-{rank}.pt")


def _plans(out: Path) -> None:
    """Each rank cuts a 3-block chain elsewhere: the runtime must refuse before any batch moves."""
    rank = int(os.environ["RANK"])
    compiled = ppll_compile.compile(Chain(3), example_inputs=(torch.randn(8, 8),), split_points=[f"blocks.{rank}"])
    try:
        compiled.trainer(optimizer=sgd, runtime="distributed", timeout=60)
        text = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        text = f"{type(e).__name__}: {e}"
    (out / f"plans-{rank}.json").write_text(json.dumps({"text": text}))


def _raise(error: BaseException) -> Any:
    raise error


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    scenario, out = argv[0], Path(argv[1])
    if scenario == "fifo":
        k, load = int(argv[2]), (argv[3] if len(argv) > 3 else None)
        rank = int(os.environ["RANK"])
        with fifo_pipeline(k, "distributed") as trainer:
            record = fifo_program(trainer, out / f"fifo-{k}", load)
        torch.save(record, out / f"fifo-{k}" / f"rank-{rank}.pt")
    elif scenario == "distill":
        runtime, layout = argv[2], argv[3]
        rank = int(os.environ["RANK"])
        options = {"decoupled": False} if layout == "relay" else {}
        with distill_pipeline(runtime, "two" if layout == "relay" else layout, **options) as trainer:
            record = distill_program(trainer, out / layout)
        torch.save(record, out / layout / f"rank-{rank}.pt")
    elif scenario == "distill-raise":  # stage 1's first student block raises on its third batch
        rank = int(os.environ["RANK"])
        trainer = distill_pipeline("distributed", "two")
        block = trainer.lowered.modules[2]
        calls = iter(range(100))
        forward = block.forward
        block.forward = lambda *v: forward(*v) if next(calls) != 2 else _raise(RuntimeError("student broke"))
        try:
            with trainer:
                trainer.fit([(x, y) for x, y in seeded_batches(4, [8] * 8, (3, 16, 16), 10)], epochs=1, progress=False)
            text, kind = "no error", None
        except Exception as e:  # noqa: BLE001 - reported to the test
            text, kind = str(e), type(e).__name__
        (out / f"error-{rank}.json").write_text(json.dumps({"text": text, "type": kind, "time": time.time()}))
        sys.exit(1 if kind else 0)
    elif scenario == "replicated":
        rank = int(os.environ["RANK"])
        with replicated_chain("distributed") as trainer:
            torch.save(replicated_program(trainer), out / f"replicated-{rank}.pt")
    elif scenario == "raise":
        _fault(out, 3, "raise", 1)
    elif scenario == "nan":
        _fault(out, 2, "nan", 0, nan_check=True)
    elif scenario == "exit":
        _fault(out, 3, "exit", 1)
    elif scenario == "stay":
        _stay(out, replicated=False)
    elif scenario == "stay-replica":
        _stay(out, replicated=True)
    elif scenario == "reuse":
        _reuse(out)
    elif scenario == "newest":
        _newest(out)
    elif scenario == "early":
        _early(out)
    elif scenario == "momentum":
        _momentum(out)
    elif scenario == "accumulate":
        rank = int(os.environ["RANK"])
        with accumulate_pipeline("distributed") as trainer:
            record = accumulate_program(trainer)
        torch.save(record, out / f"accumulate-{rank}.pt")
    elif scenario == "plans":
        _plans(out)
    elif scenario == "latest-steps":
        _latest_steps(out, int(argv[2]))
    elif scenario == "frozen":
        _frozen(out, argv[2])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")


# ---- gradient accumulation -----------------------------------------------------------------------------------

ACCUMULATE_SIZES = [8, 8, 8, 8, 8, 8, 5]  # accumulate=3: two whole groups, then a partial one of one batch


def accumulate_pipeline(runtime: str) -> Any:
    """Residual in 2 stages (DGL heads) trained with ``accumulate=3``."""
    torch.manual_seed(0)
    compiled = ppll_compile.compile(Residual(), example_inputs=(torch.randn(8, 3, 8, 8),), split_points=["add"],
                                    policy="dgl")
    return compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60, accumulate=3)


def accumulate_program(trainer: Any) -> dict[str, Any]:
    """7 batches stepped (a partial group at the end) and finished, then a 2-epoch fit; states and counters."""
    for x, y in seeded_batches(5, ACCUMULATE_SIZES, (3, 8, 8), 5):
        trainer.step(x, y)
    trainer.finish()
    after_steps = stage_states(trainer)
    history = trainer.fit(seeded_batches(6, [8, 8, 6, 8], (3, 8, 8), 5), epochs=2, progress=False)
    return {"after_steps": after_steps, "final": stage_states(trainer), "history": [h["loss"] for h in history],
            "steps": trainer.steps, "updates": trainer.updates}


def _child(rank: int, k: int, port: int, argv: list[str], body: Callable[[list[str]], None]) -> None:
    """Body of a forked worker: rank ``rank`` of ``k`` runs ``body(argv)``; never returns."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(k), OMP_NUM_THREADS="1")
    code = 0
    try:
        body(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(k: int, port: int, argv: list[str], timeout: float, body: Callable[[list[str]], None] = main) -> None:
    """Fork ``k`` workers running ``body(argv)`` (a scenario of :func:`main` by default; torch and the compiler
    imported once, before any thread starts); print their exit codes.

    A worker still running after ``timeout`` seconds is killed and reported as ``null``.
    """
    import torch._dynamo  # noqa: F401 - imported by compile(); loaded once here instead of in every worker

    pids = []
    for rank in range(k):
        pid = os.fork()
        if pid == 0:
            _child(rank, k, port, argv, body)
        pids.append(pid)
    deadline = time.monotonic() + timeout
    codes: dict[int, int | None] = {}
    while len(codes) < k and time.monotonic() < deadline:
        for rank, pid in enumerate(pids):
            if rank not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[rank] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for rank, pid in enumerate(pids):
        if rank not in codes:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    print(json.dumps({"codes": [codes.get(r) for r in range(k)]}), flush=True)



# ---- queue="latest" under the step loop; a frozen last stage ------------------------------------------------

LATEST_TIMEOUT = 30.0
"""The process group's timeout of the ``latest-steps`` scenario: a deadlock would wait this long."""


def _latest_steps(out: Path, epochs: int) -> None:
    """``queue="latest"`` fed by the README's loop (``for x, y in loader: trainer.step(x, y)``, then ``finish()``)
    for ``epochs`` epochs of 30 batches; the last stage sleeps 20 ms per batch, so it drops inputs.

    Each rank writes the losses step() and finish() returned for its stage, its counters and its seconds."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = chain_pipeline(world, "distributed", Trap("sleep", 0.02), world - 1, queue="latest", queue_depth=1,
                             timeout=LATEST_TIMEOUT)
    stage = trainer.stages[0]
    returned: list[list[float]] = []
    start = time.monotonic()
    with trainer:
        for _ in range(epochs):
            losses: list[float] = []
            for x, y in seeded_batches(11, [8] * 30, (8,), 4):
                losses += trainer.step(x if rank == 0 else None, y if rank == 0 else None)[stage]
            losses += trainer.finish()[stage]
            returned.append(losses)
    record = {"stage": stage, "losses": returned, "steps": trainer.steps[stage], "dropped": trainer.dropped[stage],
              "seconds": time.monotonic() - start}
    (out / f"latest-{rank}.json").write_text(json.dumps(record))


FROZEN_TIMEOUT = 4.0
"""The process group's timeout of the ``frozen`` scenario (seconds)."""


def _frozen(out: Path, how: str) -> None:
    """3 stages under FIFO; the last rank freezes before its forward on batch 3: ``stop`` sends itself SIGSTOP,
    ``sleep`` sleeps far past the process group's timeout. Ranks 0 and 1 write the error they raised; rank 0 then
    kills the frozen rank (its pid in ``frozen.pid``)."""
    import signal

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trainer = chain_pipeline(world, "distributed", None, 0, timeout=FROZEN_TIMEOUT)
    if rank == world - 1:
        calls = iter(range(10**6))

        def freeze(*_: Any) -> None:
            if next(calls) == 3:
                (out / "frozen.pid").write_text(str(os.getpid()))
                if how == "stop":
                    os.kill(os.getpid(), signal.SIGSTOP)
                else:
                    time.sleep(120)

        trainer.lowered.modules[world - 1].register_forward_pre_hook(freeze)
    text, kind, raised = "no error", None, None
    try:
        with trainer:
            try:
                trainer.fit(seeded_batches(4, [8] * 40, (8,), 4), epochs=1, progress=False)
            except Exception as e:  # noqa: BLE001 - reported to the test
                text, kind, raised = str(e), type(e).__name__, time.time()
                raise
    except Exception:  # noqa: BLE001
        pass
    frozen_at = float((out / "frozen.pid").stat().st_mtime) if (out / "frozen.pid").exists() else None
    (out / f"frozen-{rank}.json").write_text(json.dumps({"text": text, "type": kind, "raised": raised,
                                                         "frozen_at": frozen_at, "closed": time.time()}))
    if rank == 0:
        _wait_for(out / "frozen-1.json", "rank 1 never wrote its error")
        os.kill(int((out / "frozen.pid").read_text()), signal.SIGKILL)


if __name__ == "__main__":
    # python tests/dist_worker.py K PORT TIMEOUT SCENARIO OUT [ARG]
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]))
