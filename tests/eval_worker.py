"""Workers of the distributed evaluate test: ``python tests/eval_worker.py K PORT TIMEOUT OUT``.

The test imports the same functions to run the sequential reference in-process: both sides build the same model
from the same seed, train it on the same batches and evaluate it on the same held-out batches.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root: ``tests.…`` imports

from dist_worker import launch  # noqa: E402

import ppll_compile  # noqa: E402
from tests.helpers import sgd  # noqa: E402

__all__ = ["TinyLM", "token_batches", "lm_pipeline", "lm_program", "METRICS", "main"]

warnings.simplefilter("ignore")  # the CPU fallback note of compile()

VOCAB, LENGTH = 11, 6


class TinyLM(nn.Module):
    """A causal-LM-shaped model: embedding, two position-wise blocks, a projection to the vocabulary (N x L x V)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.b1 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.b2 = nn.Sequential(nn.Linear(16, 16), nn.ReLU())
        self.out = nn.Linear(16, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.b2(self.b1(self.emb(ids))))


def token_batches(seed: int, sizes: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of token ids and next-token labels, the last position and a varying prompt labelled -100."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for k, n in enumerate(sizes):
        ids = torch.randint(0, VOCAB, (n, LENGTH), generator=g)
        labels = ids.roll(-1, 1)
        labels[:, -1] = -100
        labels[0, : k + 1] = -100  # batches keep different numbers of labels
        batches.append((ids, labels))
    return batches


def lm_pipeline(runtime: str) -> Any:
    """:class:`TinyLM` in 2 stages (cut after ``b1``), its weights drawn after ``manual_seed(0)``."""
    torch.manual_seed(0)
    compiled = ppll_compile.compile(TinyLM(), 2, example_inputs=(torch.randint(0, VOCAB, (4, LENGTH)),),
                                    split_points=["b1"])
    return compiled.trainer(optimizer=sgd, runtime=runtime, timeout=60)


def _token_accuracy(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    kept = labels != -100
    return ((output.argmax(-1) == labels) & kept).sum() / kept.sum()


METRICS = {"token_accuracy": _token_accuracy,
           "first_token_loss": lambda out, y: float(F.cross_entropy(out[:, 1], y[:, 1], ignore_index=-100))}
"""User metrics of the model's output, as ``evaluate(metrics=...)`` takes them."""


def lm_program(trainer: Any) -> dict[str, Any]:
    """Train 3 batches, then evaluate 3 held-out batches of different sizes with :data:`METRICS`."""
    trainer.fit(token_batches(1, [4, 4, 4]), epochs=1, progress=False)
    return trainer.evaluate(token_batches(2, [4, 3, 2]), metrics=METRICS)


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    out = Path(argv[0])
    rank = int(os.environ["RANK"])
    with lm_pipeline("distributed") as trainer:
        torch.save(lm_program(trainer), out / f"evaluate-{rank}.pt")


if __name__ == "__main__":
    # python tests/eval_worker.py K PORT TIMEOUT OUT
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:], float(sys.argv[3]), body=main)
