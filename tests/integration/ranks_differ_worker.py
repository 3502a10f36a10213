"""A rank of the ranks-differ test, started by torchrun: ``ranks_differ_worker.py OUT CASE...``.

For each case, rank 1 builds another model than rank 0 (``relu``: one more ReLU; ``width``: hidden layers twice as
wide; ``short``: one linear layer, without rank 0's cut), compiles it for two stages and trains under the distributed
runtime: each rank plans on its own, or with ``shared-`` before the case, rank 0 plans and shares its plan. Each rank prints the error it raises to
its stderr as ``rank R, CASE: TYPE: MESSAGE`` and goes on to the next case; ``trained`` is printed if one trains.
A rank exits 0 once every case ran, so that torchrun stops no rank while another is still reporting.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn

import ppll_compile

warnings.simplefilter("ignore")  # the CPU fallback note of compile()


def model(case: str, rank: int) -> nn.Module:
    """Rank 0's model; rank 1's differs as ``case`` says."""
    if case == "short" and rank == 1:
        return nn.Linear(8, 4)
    width = 32 if case == "width" and rank == 1 else 16
    extra = [nn.ReLU()] if case == "relu" and rank == 1 else []
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, width), *extra, nn.ReLU(),
                         nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def run(case: str, rank: int) -> None:
    """Compile ``case``'s model at the cut after the second linear layer and train it on three batches. Each rank
    plans on its own (``share_plan=False``: the trainer compares the ranks' models), or for ``shared-CASE`` rank 0
    plans and the others lower its plan (compile compares them)."""
    shared = case.startswith("shared-")
    compiled = ppll_compile.compile(model(case.removeprefix("shared-"), rank), gpus=2,
                                    example_inputs=(torch.randn(4, 8),), split_points=["_2"], share_plan=shared)
    data = [(torch.randn(4, 8), torch.randint(0, 4, (4,))) for _ in range(3)]
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="distributed",
                          timeout=60) as trainer:
        trainer.fit(data, progress=False)
    print(f"rank {rank}, {case}: trained", flush=True)


def main() -> None:
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    for case in sys.argv[2:]:
        try:
            run(case, rank)
        except Exception as e:  # noqa: BLE001 - reported for the test to read
            line = f"rank {rank}, {case}: {type(e).__name__}: {' '.join(str(e).splitlines())}\n"
            os.write(sys.stderr.fileno(), line.encode())  # one write: the two ranks' lines do not interleave


if __name__ == "__main__":
    main()
