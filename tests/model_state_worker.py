"""Worker of the trained-model tests under torchrun: ``torchrun --nproc-per-node=2 tests/model_state_worker.py OUT``.

The test imports the same functions to run the sequential reference in-process, so both sides build the same models
from the same seed and train them on the same batches.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

import ppll_compile  # noqa: E402
from meta_worker import residual_pipeline  # noqa: E402
from tests.helpers import seeded_batches, sgd  # noqa: E402

__all__ = ["TiedNet", "tied_pipeline", "meta_pipeline", "train", "PIPELINES", "main"]

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


def tied_pipeline() -> Any:
    """:class:`TiedNet` (seed 0) in 2 stages cut after ``block0``, the tied embedding untied."""
    torch.manual_seed(0)
    return ppll_compile.compile(TiedNet(), example_inputs=(torch.randint(0, VOCAB, (8,)),), policy="dgl",
                                split_points=["block0_1"], tied="untie")


def meta_pipeline() -> Any:
    """The Residual of the meta tests built on the meta device (each rank materialises its own stage only)."""
    return residual_pipeline(meta=True)


def reference_pipeline() -> Any:
    """The same Residual built normally: the sequential reference of :func:`meta_pipeline`."""
    return residual_pipeline(meta=False)


def _tied_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, VOCAB, (n,), generator=g), torch.randint(0, VOCAB, (n,), generator=g))
            for n in (8, 8, 8, 5)]


PIPELINES = {"tied": (tied_pipeline, _tied_batches),
             "meta": (meta_pipeline, lambda: seeded_batches(1, [8, 8, 8, 5], (3, 8, 8), 5))}
"""Per scenario: the pipeline builder and its training batches."""


def train(compiled: Any, runtime: str, batches: list, out: Path, name: str) -> dict[str, Any]:
    """Train ``compiled`` on ``batches`` under ``runtime``; then ``model_state_dict()`` and ``save_model`` to
    ``out/name.safetensors`` and ``out/name.pt``: the dict (or ``None``) and the paths returned."""
    with compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
        for x, y in batches:
            trainer.step(x, y)
        state = trainer.model_state_dict()
        paths = [str(trainer.save_model(out / f"{name}.safetensors")), str(trainer.save_model(out / f"{name}.pt"))]
        stages = list(trainer.stages)
    return {"state": state, "paths": paths, "stages": stages}


def main(out: Path) -> None:
    """One rank: every scenario of :data:`PIPELINES` trained distributed; what each rank got, in ``out``."""
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    # one process group for both trainers: a group made and destroyed by each would reuse the same keys of
    # torchrun's store, and the second could read the first's stale addresses
    dist.init_process_group("gloo")
    record = {}
    try:
        for name, (build, batches) in PIPELINES.items():
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
