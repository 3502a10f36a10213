"""Rank 0's memory while the trained model is gathered under torchrun: ``model_state_dict()``, ``save_model(file)``
and ``save_model(dir, sharded=True)`` of a Llama-shaped model built normally, each in a job of its own.

    PPLL_MALLOC=default torchrun --standalone --nproc-per-node=3 benchmarks/gather_memory.py OUT state|file|sharded

Rank 0 samples its resident memory (``VmRSS`` of ``/proc/self/status``) every millisecond in a thread while the
call runs, and writes to ``OUT/gather-OP.json`` the resident memory before the call, the highest sampled during it,
the model's bytes and (where the trainer counts it) the gather's own peak. ``PPLL_MALLOC=default`` leaves glibc's
allocator as it is, so that memory freed during training is returned and the figures show what the call holds.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import ppll_compile

warnings.simplefilter("ignore")
MIB = 1 << 20


def rss() -> int:
    """This process's resident bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class Peak:
    """The highest resident memory sampled every millisecond between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.high = rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.high = max(self.high, rss())
            time.sleep(0.001)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.high = max(self.high, rss())
        return self.high


def llama(layers: int) -> torch.nn.Module:
    """A Llama shape (hidden 1024, MLP 2816, 16 heads, 32k vocabulary), weights from seed 0, eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=64,
                         attn_implementation="eager")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def main(out: Path, op: str, layers: int = 4) -> None:
    torch.set_num_threads(1)
    model = llama(layers)
    world = int(os.environ["WORLD_SIZE"])
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = ppll_compile.compile(model, world, example_kwargs={"input_ids": ids})
    target = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), runtime="distributed",
                          timeout=600) as trainer:
        trainer.step({"input_ids": ids}, target)
        trainer.finish()
        dist.barrier()
        before = rss()
        peak = Peak()
        if op == "state":
            state = trainer.model_state_dict()  # noqa: F841 - held until the peak is taken
        elif op == "file":
            trainer.save_model(out / "model.safetensors")
        else:
            trainer.save_model(out / "sharded", sharded=True)
        high = peak.stop()
        stats = getattr(trainer, "gather_stats", None)
        rank = dist.get_rank()
    if rank == 0:
        row = {"op": op, "processes": world, "model_mib": model_bytes / MIB, "rss_before_mib": before / MIB,
               "rss_peak_mib": high / MIB, "growth_mib": (high - before) / MIB,
               "gather_peak_mib": None if stats is None else stats.peak_bytes / MIB,
               "load": os.getloadavg()}
        (out / f"gather-{op}.json").write_text(json.dumps(row, indent=2))
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2], *map(int, sys.argv[3:]))
