"""Workers of the one-plan test: ``python tests/one_plan_worker.py K PORT TIMEOUT OUT``.

Rank ``r`` plans with the calibration cache ``OUT/cache-r`` (which the test leaves empty or fills with other device
figures) and no pinned figures, so that on their own the ranks would choose different cuts. The test imports the same
functions to build the sequential reference in-process.
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from dist_worker import launch, stage_states  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import seeded_batches, sgd  # noqa: E402

__all__ = ["Mixed", "X", "SIZES", "mixed_pipeline", "meta_pipeline", "tensors", "train", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

X = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
"""The example input every compile traces."""
SIZES = [32, 32, 32, 20]
"""The batches every run trains on (the last one smaller)."""


class _Elementwise(nn.Module):
    """``k`` rounds of elementwise math, then a layer norm: priced by the device's memory-bound rates."""

    def __init__(self, k: int, d: int) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.k):
            x = torch.tanh(x) * 0.5 + x
        return self.norm(x)


class Mixed(nn.Module):
    """Blocks alternately matrix-product-heavy and elementwise-heavy: where the cuts go depends on the device's
    figures (its matmul rate against its memory-bound rates)."""

    def __init__(self, n: int = 6, d: int = 64) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, d), nn.ReLU()) if i % 2 == 0 else
                                      _Elementwise(8 if i % 4 == 1 else 1, d) for i in range(n)])
        self.out = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))


def mixed_pipeline(**options: Any) -> Any:
    """:class:`Mixed` (weights from seed 0) compiled for 3 devices with DGL heads."""
    torch.manual_seed(0)
    return ppll_compile.compile(Mixed(), gpus=3, example_inputs=(X,), policy="dgl", **options)


def meta_pipeline(**options: Any) -> Any:
    """:class:`Mixed` built on the meta device (seed 0) compiled for 3 devices, filled by its own initialisation."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Mixed()
    return ppll_compile.compile(model, gpus=3, example_inputs=(X,), policy="dgl", **options)


def tensors(compiled: Any, stages: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Per stage of ``stages``: its block's and its head's tensors, as they are now."""
    out = {}
    for i in stages:
        head = compiled.heads[i]
        out[i] = {f"block.{k}": v.detach().clone() for k, v in compiled.stages[i].state_dict().items()} | \
                 ({f"head.{k}": v.detach().clone() for k, v in head.state_dict().items()} if head else {})
    return out


def train(compiled: Any, runtime: str) -> dict[int, dict[str, torch.Tensor]]:
    """Train ``compiled`` on :data:`SIZES` batches under ``runtime``: the state of every stage this process trains."""
    with compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
        for x, y in seeded_batches(2, SIZES, (64,), 4):
            trainer.step(x, y)
        trainer.finish()
        return stage_states(trainer)


def _failing(out: Path, rank: int) -> None:
    """Every rank compiles with a memory limit no stage fits: rank 0's planning fails; what each rank raised. The
    last rank reads rank 0's error 3 s late (rank 0 hosts the store: it must not end before every rank has read)."""
    if rank == 2:
        import ppll_compile.api as api
        receive = api.receive_plan

        def late(*args: Any) -> Any:
            time.sleep(3)
            return receive(*args)
        api.receive_plan = late
    try:
        mixed_pipeline(memory_limit=1)
        text = "no error"
    except Exception as e:  # noqa: BLE001 - reported to the test
        text = f"{type(e).__name__}: {e}"
    (out / f"failed-{rank}.txt").write_text(text)


def main(argv: list[str]) -> None:
    """One rank: the meta-built Mixed compiled (its stage and head recorded), then Mixed compiled and trained; with
    ``OUT/failing``, the failing compile of :func:`_failing` instead."""
    torch.set_num_threads(1)
    out, rank = Path(argv[0]), int(os.environ["RANK"])
    if (out / "failing").exists():
        return _failing(out, rank)
    os.environ.pop("PPLL_DEVICE_FIGURES", None)  # plan with this rank's own calibration cache
    os.environ["PPLL_CACHE_DIR"] = str(out / f"cache-{rank}")
    meta = meta_pipeline()  # two compiles in one process: each exchanges its own plan
    record: dict[str, Any] = {"meta_plan": meta.plan.to_json(), "meta": tensors(meta, [rank])}
    compiled = mixed_pipeline()
    record |= {"plan": compiled.plan.to_json(), "initial": tensors(compiled, range(3))}
    record["trained"] = train(compiled, "distributed")
    record["released"] = not dist.is_initialized()  # the trainer released the group it formed
    torch.save(record, out / f"rank-{rank}.pt")


if __name__ == "__main__":
    # python tests/one_plan_worker.py K PORT TIMEOUT OUT
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]), body=main)
