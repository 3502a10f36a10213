"""The loop in real runs: under ``distributed`` ``max_steps`` and ``EarlyStopping`` stop every rank after the same
batch, the parameters equal a sequential run's, and only the main process writes the CSV log; TensorBoard's own
reader opens the event files of :class:`TensorBoardLogger`; ``dna-per-block`` counts its epochs as a total."""

# Two ranks are forked by this file's __main__ (through tests/dist_worker.py's launcher), each running _program.

from __future__ import annotations

import csv
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.runtime.callbacks import Callback, EarlyStopping
from ppll_compile.runtime.loggers import CSVLogger, TensorBoardLogger

pytestmark = pytest.mark.slow  # forks worker processes
LIMIT = 120.0
"""Seconds the ranks get before they are killed (a hang fails the test)."""


def _compiled() -> ppll_compile.CompiledPipeline:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    return ppll_compile.compile(model, 2, example_inputs=(torch.randn(8, 6),), devices=["cpu", "cpu"],
                                optimizer="momentum")


def _data(seed: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def _program(trainer, out: Path, tag: str) -> dict:
    """Fit until EarlyStopping (a metric that only grows: best at epoch 1, patience 2) ends epoch 3, then fit on
    until max_steps=14 stops inside epoch 4; what every rank saw."""
    calls = []

    def worse(output, target) -> float:
        calls.append(1)
        return float(len(calls))

    sizes: list[tuple[int, list]] = []  # per step record and stage: how many losses came, and their batch sizes

    class Sizes(Callback):
        def on_step_end(self, trainer, record):
            sizes.extend((len(ls), s) for ls, s in zip(record["losses"], record["sizes"]))

    stop = EarlyStopping("worse", patience=2)
    first = trainer.fit(_data(1, 4), epochs=6, max_steps=20, progress=False, evaluate=_data(2, 1),
                        metrics={"worse": worse}, callbacks=[stop, CSVLogger(out / f"{tag}.csv"), Sizes()])
    second = trainer.fit(_data(1, 4), epochs=6, max_steps=14, progress=False)

    def strip(h: list) -> list:
        return [{k: v for k, v in r.items() if k not in ("seconds", "samples_per_s")} for r in h]

    return {"first": strip(first), "second": strip(second), "epoch": trainer.epoch, "updates": trainer.updates,
            "stopped": stop.stopped_epoch, "sizes": sizes}


def _body(argv: list[str]) -> None:
    torch.set_num_threads(1)
    out, rank = Path(argv[0]), int(os.environ["RANK"])
    compiled = _compiled()
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05), runtime="distributed", timeout=60) \
            as trainer:
        record = _program(trainer, out, f"log-{rank}")
        state = trainer.model_state_dict()
    (out / f"rank-{rank}.json").write_text(json.dumps(record))
    if rank == 0:
        torch.save(state, out / "model.pt")


def test_max_steps_and_early_stopping_stop_every_rank_as_a_sequential_run(tmp_path):
    from tests.helpers import free_port
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.Popen([sys.executable, __file__, str(free_port()), str(tmp_path)], env=env, text=True,
                            cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text = proc.communicate(timeout=LIMIT + 30)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"the 2-rank run was still going after {LIMIT + 30} s:\n{proc.communicate()[0][-3000:]}")
    assert '{"codes": [0, 0]}' in text, text[-3000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]

    compiled = _compiled()
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05)) as trainer:
        ref = _program(trainer, tmp_path, "sequential")
        state = trainer.model_state_dict()
    assert [(r["epoch"], r["samples"]) for r in ref["first"] + ref["second"]] == [(1, 32), (2, 32), (3, 32), (4, 16)]
    assert (ref["epoch"], ref["updates"], ref["stopped"]) == (3, {0: 14, 1: 14}, 3)
    assert ref["sizes"] and all(s == [8] * n for n, s in ref["sizes"])
    for rank, got in enumerate(ranks):
        assert (got["epoch"], got["updates"], got["stopped"]) == (3, {str(rank): 14}, 3)
        assert all(s == [8] * n for n, s in got["sizes"]), got["sizes"]  # every loss with its batch size, every rank
        for ours, theirs in zip(got["first"] + got["second"], ref["first"] + ref["second"], strict=True):
            assert (ours["epoch"], ours["samples"]) == (theirs["epoch"], theirs["samples"])
            assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
            if "evaluate" in theirs:
                assert ours["evaluate"]["worse"] == theirs["evaluate"]["worse"]
                assert ours["evaluate"]["loss"] == pytest.approx(theirs["evaluate"]["loss"], rel=1e-5)
    ours = torch.load(tmp_path / "model.pt", weights_only=True)
    assert ours.keys() == state.keys() and all(torch.allclose(ours[k], v, atol=1e-6) for k, v in state.items())
    assert not (tmp_path / "log-0.csv").exists()  # rank 0 runs the first stage; the main process writes
    with (tmp_path / "log-1.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["kind"] for r in rows if r["kind"] != "step"] == ["evaluate", "epoch"] * 3
    assert [float(r["worse"]) for r in rows if r["kind"] == "evaluate"] == [1.0, 2.0, 3.0]


def test_tensorboard_reads_back_the_scalars_of_every_step_epoch_and_evaluation(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    compiled = _compiled()
    steps: list[dict] = []

    class Steps(Callback):
        def on_step_end(self, trainer, record):
            steps.append(record)

    logger = TensorBoardLogger(tmp_path / "runs")
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05)) as trainer:
        history = trainer.fit(_data(1, 3), epochs=2, progress=False, callbacks=[logger, Steps()],
                              evaluate=_data(2, 2))
    logger.close()
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()

    def scalars(tag: str) -> list[tuple[int, float]]:
        return [(e.step, e.value) for e in events.Scalars(tag)]

    for i in range(2):
        assert scalars(f"train/loss/stage{i}") == [(r["batch"], pytest.approx(r["loss"][i])) for r in steps]
        assert scalars(f"train/lr/stage{i}") == [(r["batch"], pytest.approx(0.05)) for r in steps]
        assert scalars(f"epoch/loss/stage{i}") == [(3 * r["epoch"], pytest.approx(r["loss"][i])) for r in history]
        assert scalars(f"eval/stage_loss/stage{i}") == [
            (3 * r["epoch"], pytest.approx(r["evaluate"]["stage_loss"][i])) for r in history]
    assert scalars("eval/accuracy") == [(3 * r["epoch"], pytest.approx(r["evaluate"]["accuracy"])) for r in history]
    assert scalars("epoch/samples_per_s") == [(3 * r["epoch"], pytest.approx(r["samples_per_s"])) for r in history]


def test_dna_per_block_counts_its_epochs_from_the_start_of_training():
    from tests.models import conv_student, conv_teacher
    x = torch.randn(8, 3, 16, 16)
    torch.manual_seed(0)
    compiled = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(x,), split_points=["5"],
                                    replicas=(1, 1), devices=["cpu", "cpu"], optimizer="momentum")
    with compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), runtime="dna-per-block") \
            as trainer:
        assert [r["epoch"] for r in trainer.fit([(x, None)], epochs=2, progress=False)] == [1, 2]
        assert (trainer.epoch, trainer.batches) == (2, 2)
        with pytest.warns(UserWarning, match=re.escape("fit(epochs=2) trains nothing: this trainer has already "
                                                       "trained 2 epoch(s)")):
            assert trainer.fit([(x, None)], epochs=2, progress=False) == []
        assert [r["epoch"] for r in trainer.fit([(x, None)], epochs=3, progress=False)] == [3]
        assert (trainer.epoch, trainer.batches) == (3, 3)


if __name__ == "__main__":
    # python tests/integration/test_loop_dist_runs.py PORT OUT: two ranks of _body, killed after LIMIT seconds
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import dist_worker
    dist_worker.launch(2, int(sys.argv[1]), [sys.argv[2]], LIMIT, body=_body)
