"""Recovery from a killed process: ``torchrun --standalone --nproc-per-node=3 --max-restarts=1`` of a 3-stage
pipeline under ``runtime="distributed"``, trained by ``fit(loader, checkpoint=dir, every=EVERY)``, whose middle rank
SIGKILLs itself once. Measured: seconds from the kill to the restarted processes' start, to their working process
group and trainer, and to the next trained batch; and the batches of work lost (trained since the last checkpoint
and trained again).

A full restart is the only mode: torchrun restarts every process of the job, and a gloo process group cannot take
one new process in, so no single stage is replaced on its own (docs/recovery.md).
"""

from __future__ import annotations

import time

STARTED = time.time()  # when this process began, before torch is imported (a restarted worker's start)

import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

from .report import Section, standalone  # noqa: E402

__all__ = ["EVERY", "KILL_AT", "KILL_RANK", "main", "measure", "section"]

ROOT = Path(__file__).resolve().parent.parent
BATCHES = 12
"""Batches of the one epoch trained."""
EVERY = 4
"""Batches between two checkpoints."""
KILL_AT = 7
"""The batch (counted from 0) whose forward kills the process: 3 batches after the checkpoint at batch 4."""
KILL_RANK = 1
"""The process that is killed: the middle stage's."""
TIMEOUT = 300.0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(32, 10))


def _loader() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))
            for _ in range(BATCHES)]


def _checkpoint_batches(root: Path) -> int:
    try:
        name = (root / "latest").read_text().strip()
        return json.loads((root / name / "manifest.json").read_text())["trainer"]["batches"]
    except FileNotFoundError:
        return 0


def _worker(out: Path) -> None:
    """One process of the job: train, kill itself once (rank :data:`KILL_RANK`, first incarnation), and in the
    restarted incarnation write when it started, when its trainer was ready and when its first batch was trained."""
    import ppll_compile

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    root = out / "ckpt"
    resumed_from = _checkpoint_batches(root)
    # fixed cuts: a plan measured by each process on its own could differ between them (and be refused)
    compiled = ppll_compile.compile(_model(), example_inputs=(torch.randn(16, 3, 16, 16),), policy="dgl",
                                    split_points=["_3", "_5"])
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                          runtime="distributed") as trainer:
        ready = time.time()
        seen = [0]

        def before(_module: Any, _args: Any) -> None:
            if attempt == 0 and rank == KILL_RANK and seen[0] == KILL_AT:
                (out / "killed.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            seen[0] += 1

        def after(_module: Any, _args: Any, _output: Any) -> None:
            if attempt > 0 and seen[0] == 1:
                (out / f"resumed-{rank}.json").write_text(json.dumps(
                    {"started": STARTED, "ready": ready, "trained": time.time(), "from": resumed_from}))

        module = trainer.lowered.modules[trainer.stages[0]]
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)
        trainer.fit(_loader(), epochs=1, checkpoint=root, every=EVERY, progress=False)


def measure(timeout: float = TIMEOUT) -> dict[str, Any]:
    """Run the job once; the seconds from the kill to each point of the recovery, and the batches lost."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=3",
               "--max-restarts=1", "--module", "benchmarks.recovery", "--worker", str(out)]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, check=False)
        seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"the torchrun job exited {proc.returncode}:\n{proc.stdout[-4000:]}")
        try:
            killed = json.loads((out / "killed.json").read_text())["time"]
            resumed = [json.loads((out / f"resumed-{r}.json").read_text()) for r in range(3)]
        except FileNotFoundError as e:
            raise RuntimeError(f"the torchrun job did not leave {Path(e.filename).name}:\n{proc.stdout[-4000:]}") \
                from None
    resumed_from = resumed[0]["from"]
    return {"processes": 3, "killed_rank": KILL_RANK, "killed_at_batch": KILL_AT, "every": EVERY,
            "batches": BATCHES, "resumed_from_batch": resumed_from, "batches_lost": KILL_AT - resumed_from,
            "to_restarted_s": min(r["started"] for r in resumed) - killed,
            "to_trainer_ready_s": max(r["ready"] for r in resumed) - killed,
            "to_next_trained_batch_s": max(r["trained"] for r in resumed) - killed,
            "job_s": seconds, "cpus": os.cpu_count()}


def _markdown(r: dict[str, Any]) -> str:
    return (f"`torchrun --standalone --nproc-per-node=3 --max-restarts=1`, a 3-stage pipeline under "
            f"`runtime=\"distributed\"` (gloo) trained by `fit(loader, checkpoint=dir, every={r['every']})`; rank "
            f"{r['killed_rank']} (the middle stage) SIGKILLs itself at batch {r['killed_at_batch']}. A full "
            f"restart is the only mode: torchrun restarts every process, and a gloo group cannot readmit one "
            f"(see docs/recovery.md).\n\n"
            "| from the kill to | seconds |\n|---|---:|\n"
            f"| the restarted processes start | {r['to_restarted_s']:.1f} |\n"
            f"| every restarted process has its group, plan and trainer | {r['to_trainer_ready_s']:.1f} |\n"
            f"| the next trained batch (every stage's first forward) | {r['to_next_trained_batch_s']:.1f} |\n\n"
            f"Batches of work lost: {r['batches_lost']} (trained after the checkpoint at batch "
            f"{r['resumed_from_batch']} and trained again). The whole job ({r['batches']} batches, the kill and "
            f"the restart) took {r['job_s']:.0f} s on {r['cpus']} CPUs; most of the recovery is starting Python "
            f"and torch and compiling the pipeline again in every process.\n")


def section(*, quick: bool, out: Path) -> Section:  # noqa: ARG001 - one short run either way
    """One job, one kill: seconds from the kill to training again, and batches lost."""
    res = measure()
    return Section(key="recovery", title="Recovery: seconds from a killed process to the next trained batch",
                   results=res, markdown=_markdown(res))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        _worker(Path(argv[1]))
        return 0
    return standalone(section, argv, __doc__)


if __name__ == "__main__":
    raise SystemExit(main())
