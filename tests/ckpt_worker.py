"""Processes that save checkpoints and are killed, and the processes that load what they left.

``python tests/ckpt_worker.py kill ROOT KILLS SEED`` (the kill test): a trainer process, forked, trains and
saves after every batch, resuming from the newest checkpoint; it is SIGKILLed at a random moment; then a fresh
forked process loads ``ROOT`` and checks it against a run that never stopped. Torch and the compiler are
imported once, before any fork; the launcher itself runs no torch operation. Prints one JSON line.

``python tests/ckpt_worker.py dist SCENARIO OUT PORT`` runs a two-process scenario of the ``distributed``
runtime (forked by :func:`dist_worker.launch`) and writes each rank's findings to ``OUT/rank-R.json``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ppll_compile  # noqa: E402
from ppll_compile.runtime.checkpoint import store as checkpoint
from tests.helpers import sgd  # noqa: E402
from tests.models import Residual  # noqa: E402

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

BATCH = 8


def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i`` of a run: the same for every process."""
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def pipeline(seed: int = 0, gpus: int = 2) -> Any:
    torch.manual_seed(seed)
    return ppll_compile.compile(Residual(c=16), gpus, example_inputs=(torch.randn(BATCH, 3, 8, 8),), policy="dgl")


def parameters(compiled: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for i in range(compiled.plan.num_stages) for p in compiled.stage_parameters(i)]


def _train_and_save(root: Path, ready: int) -> None:
    """Resume from the newest checkpoint under ``root`` (if any), then train and save after every batch for good;
    writes a byte to the pipe ``ready`` once the first save of this process is done."""
    torch.set_num_threads(1)
    trainer = pipeline().trainer(optimizer=sgd)
    if checkpoint.latest(root) is not None:
        trainer.load(root)
    told = False
    while True:
        trainer.step(*batch(trainer.batches))
        trainer.save(root, keep=2)
        if not told:
            os.write(ready, b"x")
            told = True


def _verify(root: Path) -> int:
    """Exit code of a fresh process that loads ``root``: 0 when it equals a run that never stopped."""
    torch.set_num_threads(1)
    try:
        compiled = pipeline(seed=7)  # other initial weights: all must come from the checkpoint
        loaded = compiled.trainer(optimizer=sgd)
        loaded.load(root)
    except Exception as e:  # noqa: BLE001 - reported to the test
        print(f"load failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 3
    straight = pipeline()
    trainer = straight.trainer(optimizer=sgd)
    for i in range(loaded.batches):
        trainer.step(*batch(i))
    same = all(torch.equal(p, q) for p, q in zip(parameters(compiled), parameters(straight), strict=True))
    return 0 if same else 4


def _fork(fn: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = fn(*args) or 0
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    return pid


def _leftovers(root: Path) -> dict[str, int]:
    names = [e.name for e in root.iterdir()]
    return {"temporary": sum(".tmp-" in n for n in names), "complete": sum(n.startswith("ckpt-") for n in names)}


def kill(root: Path, kills: int, seed: int) -> None:
    """Kill a saving trainer ``kills`` times at random moments; after each kill a fresh process loads ``root``."""
    import torch._dynamo  # noqa: F401 - imported by compile(); loaded once here instead of in every process

    rng = random.Random(seed)
    report: dict[str, Any] = {"verified": [], "mid_save": 0, "most_temporary": 0, "most_complete": 0,
                              "batches": []}
    for _ in range(kills):
        r, w = os.pipe()
        pid = _fork(_train_and_save, root, w)
        os.close(w)
        started = os.read(r, 1)  # after the first save of this process
        os.close(r)
        if not started:
            os.waitpid(pid, 0)
            report["verified"].append("trainer died")
            continue
        time.sleep(rng.uniform(0.0, 0.3))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        left = _leftovers(root)
        report["mid_save"] += left["temporary"] > 0
        report["most_temporary"] = max(report["most_temporary"], left["temporary"])
        report["most_complete"] = max(report["most_complete"], left["complete"])
        _, status = os.waitpid(_fork(_verify, root), 0)
        report["verified"].append(os.waitstatus_to_exitcode(status))
        found = checkpoint.latest(root)
        report["batches"].append(json.loads((found / checkpoint.MANIFEST).read_text())["trainer"]["batches"])
    print(json.dumps(report), flush=True)


# ---- two processes under the distributed runtime -----------------------------------------------------------
def _dist(argv: list[str]) -> None:
    scenario, out = argv[0], Path(argv[1])
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    found: dict[str, Any] = {}
    compiled = pipeline()
    trainer = compiled.trainer(optimizer=sgd, runtime="distributed", timeout=60)
    try:
        trainer.step(*batch(0)) if rank == 0 else trainer.step()
        first = trainer.save(out / "ckpt")
        trainer.step(*batch(1)) if rank == 0 else trainer.step()
        if scenario == "killed":  # rank 1 dies while it writes its stage file of the second save
            if rank == 1:
                checkpoint.save_stage = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
            try:
                trainer.save(out / "ckpt")
            except Exception as e:  # noqa: BLE001 - what rank 0 saw
                found["error"] = f"{type(e).__name__}: {e}"
            found["latest"] = str(checkpoint.latest(out / "ckpt").relative_to(out))
            found["first"] = str(first.relative_to(out))
        elif scenario == "corrupt":  # rank 1's stage file is damaged: no rank may load anything
            second = trainer.save(out / "ckpt")
            if rank == 1:
                path = second / "stage-1.pt"
                data = bytearray(path.read_bytes())
                data[len(data) // 2] ^= 0xFF
                path.write_bytes(bytes(data))
            trainer._runtime.barrier()
            torch.manual_seed(99)
            with torch.no_grad():
                for p in compiled.stage_parameters(rank):
                    p.add_(torch.randn_like(p))  # differs from what either checkpoint holds
            before = [p.detach().clone() for p in compiled.stage_parameters(rank)]
            try:
                trainer.load(out / "ckpt")
            except Exception as e:  # noqa: BLE001
                found["error"] = f"{type(e).__name__}: {e}"
            found["unchanged"] = all(torch.equal(p, q) for p, q in zip(before, compiled.stage_parameters(rank)))
            found["batches"] = trainer.batches
    finally:
        (out / f"rank-{rank}.json").write_text(json.dumps(found))
        trainer.close()


if __name__ == "__main__":
    if sys.argv[1] == "kill":
        kill(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        import dist_worker
        dist_worker.launch(2, int(sys.argv[4]), [sys.argv[2], sys.argv[3]], 120.0, body=_dist)
