"""Worker of the trained-model tests under torchrun: ``torchrun --nproc-per-node=N tests/model_state_worker.py OUT``
(N = 2 or 3: every scenario in N stages).

The test imports the same functions to run the sequential reference in-process, so both sides build the same models
from the same seed and train them on the same batches.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from meta_worker import copy_from, residual_pipeline  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import seeded_batches, sgd  # noqa: E402
from tests.models import Residual  # noqa: E402

__all__ = ["TiedNet", "tied_pipeline", "meta_pipeline", "train", "PIPELINES", "pipelines", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

VOCAB = 16


class TiedNet(nn.Module):
    """Token ids -> embedding -> linear -> batch norm (buffers) scaled by a buffer -> linear -> output projection
    tied to the embedding; and a layer it never calls (a parameter no stage trains)."""

    def __init__(self, vocab: int = VOCAB, d: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block0 = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.norm = nn.BatchNorm1d(d)
        self.block1 = nn.Sequential(nn.Linear(d, d), nn.ReLU())
        self.out = nn.Linear(d, vocab, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, d))
        self.unused = nn.Linear(2, 2)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.block0(self.emb(ids))
        return self.out(self.block1(self.norm(h) * self.scale))


def tied_pipeline(stages: int = 2) -> Any:
    """:class:`TiedNet` (seed 0) in 2 stages cut after ``block0`` (3: and after ``block1``), the tied embedding
    untied."""
    torch.manual_seed(0)
    return ppll_compile.compile(TiedNet(), example_inputs=(torch.randint(0, VOCAB, (8,)),), policy="dgl",
                                split_points=["block0_1", "block1_1"][:stages - 1], tied="untie")


def meta_pipeline(stages: int = 2) -> Any:
    """The Residual of the meta tests built on the meta device (each rank materialises its own stage only)."""
    return residual_pipeline(meta=True) if stages == 2 else _residual3(meta=True)


def reference_pipeline(stages: int = 2) -> Any:
    """The same Residual built normally: the sequential reference of :func:`meta_pipeline`."""
    return residual_pipeline(meta=False) if stages == 2 else _residual3(meta=False)


def _residual3(meta: bool) -> Any:
    """The Residual of :func:`meta_pipeline` in 3 stages."""
    torch.manual_seed(0)
    reference = Residual()
    x = torch.randn(8, 3, 8, 8)
    if not meta:
        return ppll_compile.compile(reference, gpus=3, example_inputs=(x,), policy="dgl")
    with torch.device("meta"):
        model = Residual()
    return ppll_compile.compile(model, gpus=3, example_inputs=(x,), policy="dgl", materialize=copy_from(reference))


def _tied_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, VOCAB, (n,), generator=g))
            for n in (8, 8, 8, 5)]


def pipelines(stages: int) -> dict[str, tuple[Callable[[], Any], Callable[[], list]]]:
    """Per scenario: the pipeline builder (in ``stages`` stages) and its training batches."""
    return {"tied": (lambda: tied_pipeline(stages), _tied_batches),
            "meta": (lambda: meta_pipeline(stages), lambda: seeded_batches(1, [8, 8, 8, 5], (3, 8, 8), 5))}


PIPELINES = pipelines(2)
"""The scenarios in 2 stages."""


def train(compiled: Any, runtime: str, batches: list, out: Path, name: str) -> dict[str, Any]:
    """Train ``compiled`` on ``batches`` under ``runtime``; then ``model_state_dict()``, ``save_model`` to
    ``out/name.safetensors``, ``out/name.pt`` and (sharded) ``out/name-sharded``, and ``stream_model_state``: the
    dict (or ``None``), the paths returned, the gather's stats after each call (``None`` where it received nothing)
    and, per part streamed, its stage, names and bytes (a tensor under two names counted once)."""
    parts: list[dict[str, Any]] = []

    def take(stage: int, part: dict[str, torch.Tensor]) -> None:
        distinct = {id(t): t for t in part.values()}.values()
        parts.append({"stage": stage, "keys": list(part), "bytes": sum(t.numel() * t.element_size() for t in distinct)})

    stats = []
    with compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
        for x, y in batches:
            trainer.step(x, y)
        state = trainer.model_state_dict()
        stats.append(trainer.gather_stats)
        paths = []
        for target, sharded in ((out / f"{name}.safetensors", False), (out / f"{name}.pt", False),
                                (out / f"{name}-sharded", True)):
            paths.append(str(trainer.save_model(target, sharded=sharded)))
            stats.append(trainer.gather_stats)
        stats.append(trainer.stream_model_state(take))
        stages = list(trainer.stages)
    shown = [None if s is None else {"parts": s.parts, "total": s.total_bytes, "peak": s.peak_bytes} for s in stats]
    return {"state": state, "paths": paths, "stages": stages, "stats": shown, "parts": parts}


def main(out: Path) -> None:
    """One rank: every scenario of :func:`pipelines` (one stage per process) trained distributed; what each rank
    got, in ``out``."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # one process group for both trainers: a group made and destroyed by each would reuse the same keys of
    # torchrun's store, and the second could read the first's stale addresses
    dist.init_process_group("gloo")
    record = {}
    try:
        for name, (build, batches) in pipelines(int(os.environ["WORLD_SIZE"])).items():
            got = train(build(), "distributed", batches(), out, name)
            state = got.pop("state")
            if state is not None:
                torch.save(state, out / f"{name}-state-{rank}.pt")
            record[name] = got | {"received": state is not None}
    finally:
        dist.destroy_process_group()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
