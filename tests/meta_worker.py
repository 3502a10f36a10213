"""Workers of the meta-model distributed test: ``python tests/meta_worker.py K PORT TIMEOUT OUT``."""

# The test imports the same functions to run the sequential reference in-process, so both sides build the
# same model from the same seed and train it on the same batches.

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from dist_worker import launch  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import seeded_batches, sgd  # noqa: E402
from tests.models import Residual  # noqa: E402

__all__ = ["copy_from", "residual_pipeline", "train_program", "meta_tensors", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

SIZES = [8, 8, 8, 5]
"""The batches every run trains on (the last one smaller)."""


def copy_from(reference: nn.Module) -> Callable[[Any, int, torch.device], None]:
    """A ``materialize=`` hook that fills a stage's tensors with ``reference``'s of the same name."""
    tensors = dict(reference.named_parameters()) | dict(reference.named_buffers())

    def fill(stage: Any, index: int, device: torch.device) -> None:
        with torch.no_grad():
            for name, t in (*stage.module.named_parameters(), *stage.module.named_buffers()):
                t.copy_(tensors[name])
    return fill


def residual_pipeline(meta: bool, tracer: str = "fx", **options: Any) -> Any:
    """:class:`Residual` (weights from seed 0) in 2 stages; with ``meta`` built on the meta device and
    materialised from the normally built one by a ``materialize=`` hook."""
    torch.manual_seed(0)
    reference = Residual()
    x = torch.randn(8, 3, 8, 8)
    if not meta:
        return ppll_compile.compile(reference, gpus=2, example_inputs=(x,), policy="dgl", tracer=tracer, **options)
    with torch.device("meta"):
        model = Residual()
    return ppll_compile.compile(model, gpus=2, example_inputs=(x,), policy="dgl", tracer=tracer,
                                materialize=copy_from(reference), **options)


def meta_tensors(compiled: Any) -> dict[int, list[str]]:
    """Per stage: the names of its block's and head's tensors still on the meta device."""
    out = {}
    for i, (stage, head) in enumerate(zip(compiled.stages, compiled.heads)):
        out[i] = [f"block.{k}" for k, t in (*stage.named_parameters(), *stage.named_buffers()) if t.is_meta] + \
                 [f"head.{k}" for k, t in ((*head.named_parameters(), *head.named_buffers()) if head else ())
                  if t.is_meta]
    return out


def train_program(compiled: Any, runtime: str) -> dict[int, dict[str, torch.Tensor]]:
    """Train ``compiled`` on :data:`SIZES` batches under ``runtime``: the state of every stage this process trains."""
    with compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60) as trainer:
        for x, y in seeded_batches(1, SIZES, (3, 8, 8), 5):
            trainer.step(x, y)
        trainer.finish()
        return {i: {f"block.{k}": v.detach().clone() for k, v in compiled.stages[i].state_dict().items()} |
                {f"head.{k}": v.detach().clone() for k, v in (compiled.heads[i].state_dict().items()
                                                              if compiled.heads[i] is not None else ())}
                for i in trainer.stages}


def main(argv: list[str]) -> None:
    """One rank: the meta-built Residual compiled (this rank's stage materialised only), trained distributed."""
    torch.set_num_threads(1)
    out, rank = Path(argv[0]), int(os.environ["RANK"])
    compiled = residual_pipeline(meta=True)
    record = {"meta": meta_tensors(compiled), "notes": compiled.plan.notes}
    record["states"] = train_program(compiled, "distributed")
    torch.save(record, out / f"rank-{rank}.pt")


if __name__ == "__main__":
    # python tests/meta_worker.py K PORT TIMEOUT OUT
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]), body=main)
