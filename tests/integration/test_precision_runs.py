"""Mixed precision (``autocast=``: bfloat16, float16 with a gradient scaler per stage) and gradient accumulation
(``accumulate=n``), held to float32 and to reference computations, the same in every runtime."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tests.helpers import free_port

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import dist_worker as w  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread_quietly")
ENV = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                        "MASTER_PORT")} | {"OMP_NUM_THREADS": "1"}


# ---- distributed --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_distributed_accumulates_like_sequential(tmp_path):
    cmd = [sys.executable, str(HERE / "dist_worker.py"), "2", str(free_port()), "75", "accumulate", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=90,
                          env=ENV)
    assert '{"codes": [0, 0]}' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    with w.accumulate_pipeline("sequential") as trainer:
        ref = w.accumulate_program(trainer)
    for rank in range(2):
        record = torch.load(tmp_path / f"accumulate-{rank}.pt", weights_only=True)
        for key in ("after_steps", "final"):
            for name, value in record[key][rank].items():
                torch.testing.assert_close(value, ref[key][rank][name], rtol=0, atol=0)
        assert record["updates"] == {rank: ref["updates"][rank]} and ref["updates"] == {0: 7, 1: 7}
    assert record["history"] == ref["history"]
