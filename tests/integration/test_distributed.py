"""The distributed runtime: one process per stage on gloo (CPU), held to the sequential runtime's numbers."""

# Worker processes are forked by tests/dist_worker.py (torch imported once) or started by torchrun; every
# launch runs in its own session under a timeout, and whatever is left when it expires is killed.

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parents[1]
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import dist_worker as w  # noqa: E402

import ppll_compile  # noqa: E402
from ppll_compile.errors import PPLLError  # noqa: E402
from tests.helpers import free_port, seeded_batches  # noqa: E402

WORKER = HERE / "dist_worker.py"
EXAMPLE = ROOT / "examples" / "train_cifar_style.py"
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_key, None)


pytestmark = pytest.mark.usefixtures("one_thread")


def _start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Every process's output; kill every process group and fail if one runs past ``timeout`` seconds."""
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        text = "\n".join(p.communicate()[0][-3000:] for p in procs)
        pytest.fail(f"processes still running after {timeout} s (killed):\n{text}")
    return outputs


def _launch(k: int, scenario: str, out: Path, *args: Any, timeout: float = 60) -> tuple[list[int | None], str]:
    """Fork ``k`` workers of ``scenario``; their exit codes (``None`` = killed after a hang) and the output."""
    cmd = [sys.executable, str(WORKER), str(k), str(free_port()), str(timeout - 15), scenario, str(out),
           *map(str, args)]
    text = _wait([_start(cmd)], timeout)[0]
    lines = [line for line in text.splitlines() if line.startswith('{"codes"')]
    assert lines, f"the launcher printed no exit codes:\n{text[-3000:]}"
    return json.loads(lines[-1])["codes"], text


def _assert_states(ours: dict[int, dict[str, torch.Tensor]], ref: dict[int, dict[str, torch.Tensor]],
                   stage: int) -> None:
    assert ours[stage].keys() == ref[stage].keys()
    for name, value in ref[stage].items():
        torch.testing.assert_close(ours[stage][name], value, msg=lambda m: f"stage {stage} {name}: {m}")


def _check_fifo(k: int, tmp_path: Path, ref: dict[str, Any]) -> list[dict[str, Any]]:
    records = [torch.load(tmp_path / f"fifo-{k}" / f"rank-{r}.pt", weights_only=True) for r in range(k)]
    for r, rec in enumerate(records):
        _assert_states(rec["after_steps"], ref["after_steps"], r)
        _assert_states(rec["final"], ref["final"], r)
        assert rec["accuracy"] == ref["accuracy"]
        assert rec["samples"] == ref["samples"]
        assert rec["steps"] == {r: ref["steps"][r]}
        # every process's fit history holds every stage's mean loss
        for ours, theirs in zip(rec["history"], ref["history"]):
            assert ours == pytest.approx(theirs, rel=1e-6)
    return records


# ---- FIFO: the same computation as the sequential runtime ---------------------------------------------

@pytest.mark.slow
def test_two_stages_equal_sequential_and_checkpoint_loads_sequentially(tmp_path):
    codes, text = _launch(2, "fifo", tmp_path, 2)
    assert codes == [0, 0], text[-3000:]
    ref = w.fifo_program(w.fifo_pipeline(2, "sequential"), tmp_path / "ref")
    _check_fifo(2, tmp_path, ref)
    # a checkpoint saved by the distributed runtime after the steps, loaded by the sequential runtime
    resumed = w.fifo_fit(w.fifo_pipeline(2, "sequential"), tmp_path / "fifo-2" / "ckpt")
    for stage in range(2):
        _assert_states(resumed["final"], ref["final"], stage)
    assert resumed["accuracy"] == ref["accuracy"]


@pytest.mark.slow
def test_three_stages_carry_the_input_and_resume_from_a_sequential_checkpoint(tmp_path):
    # InfoPro heads after stage 1 rebuild the image: the raw input travels from rank 0 to rank 1
    ref = w.fifo_program(w.fifo_pipeline(3, "sequential"), tmp_path / "ref")
    codes, text = _launch(3, "fifo", tmp_path, 3, tmp_path / "ref" / "ckpt")
    assert codes == [0, 0, 0], text[-3000:]
    records = _check_fifo(3, tmp_path, ref)
    assert records[0]["batches"] == ref["batches"] == len(w.STEP_SIZES) + 2 * len(w.FIT_SIZES)


# ---- faults -----------------------------------------------------------------------------------------------

def _errors(tmp_path: Path, k: int) -> list[dict[str, Any]]:
    return [json.loads((tmp_path / f"error-{r}.json").read_text()) for r in range(k)]


@pytest.mark.slow
def test_a_raising_stage_stops_every_process_with_its_error(tmp_path):
    codes, text = _launch(3, "raise", tmp_path)
    assert codes == [1, 1, 1], text[-3000:]
    errors = _errors(tmp_path, 3)
    for r, e in enumerate(errors):
        assert e["type"] == "StageError"
        assert e["text"].startswith("stage 1 failed at batch 3: RuntimeError: boom at call 3"), e["text"][:500]
        assert 'raise RuntimeError(f"boom at call {n}")' in e["text"]  # stage 1's own traceback
        assert ("reported by stage 1" in e["text"]) == (r != 1)
    assert max(e["time"] for e in errors) - min(e["time"] for e in errors) < 10


@pytest.mark.slow
def test_nan_check_fails_fast_on_every_process(tmp_path):
    """Stage 0 makes a NaN output at batch 2: it fails before sending it on, so stage 1 never sees it and every
    process names stage 0 (it used to send it early, and stage 1 could fail on it first)."""
    codes, text = _launch(2, "nan", tmp_path)
    assert codes == [1, 1], text[-3000:]
    errors = _errors(tmp_path, 2)
    for e in errors:
        assert e["text"].startswith("stage 0 failed at batch 2: FloatingPointError: output holds nan (nan_check=True)")
    assert "reported by stage 0 to stage 1" in errors[1]["text"]
    assert max(e["time"] for e in errors) - min(e["time"] for e in errors) < 10


@pytest.mark.slow
def test_a_killed_process_is_named_by_the_others(tmp_path):
    codes, text = _launch(3, "exit", tmp_path)
    assert codes == [1, 17, 1], text[-3000:]
    for r in (0, 2):
        e = json.loads((tmp_path / f"error-{r}.json").read_text())
        assert e["text"].startswith("stage 1 failed: lost contact with the process of stage 1 (rank 1)"), e["text"]


# ---- queues, early forwarding ------------------------------------------------------------------------------

@pytest.mark.slow
def test_reuse_trains_inputs_again_by_the_threads_rules(tmp_path):
    codes, text = _launch(3, "reuse", tmp_path)
    assert codes == [0, 0, 0], text[-3000:]
    stats = [json.loads((tmp_path / f"reuse-{r}.json").read_text()) for r in range(3)]
    batches = 2 * 10
    for r, s in enumerate(stats):
        steps, reused = s["steps"][str(r)], s["reused"][str(r)]
        assert steps == batches + reused  # every batch arrives once (only new inputs are sent on) ...
        assert reused <= batches  # ... and is reused at most once
        assert all(loss is not None for epoch in s["loss"] for loss in epoch)
    assert stats[0]["reused"]["0"] == 0
    assert all(s["accuracy"] == stats[0]["accuracy"] and s["accuracy"]["samples"] == 16 for s in stats)
    assert stats[1]["reused"]["1"] > 0  # stage 0 sleeps: stage 1 trains again instead of waiting


@pytest.mark.slow
def test_latest_takes_the_newest_input_and_the_sender_never_waits(tmp_path):
    """Stage 1's first step waits until rank 0 fed all 8 batches (queue_depth=1); then it trains on batch 7 and
    drops 1 .. 6. Its parameters equal a hand-run reference: stage 0 on every batch, stage 1 on batches 0 and 7."""
    codes, text = _launch(2, "newest", tmp_path)
    assert codes == [0, 0], text[-3000:]
    first, last = (torch.load(tmp_path / f"newest-{r}.pt", weights_only=True) for r in range(2))
    assert first["trained"] == list(range(8)) and first["steps"] == {0: 8} and first["dropped"] == {0: 0}
    assert last["trained"] == [0, 7] and last["steps"] == {1: 2} and last["dropped"] == {1: 6}
    with w.chain_pipeline(2, "sequential", None, 0) as ref:
        s0, s1 = ref.runners
        for b, (x, y) in enumerate(seeded_batches(7, [8] * 8, (8,), 4)):
            out, _ = s0.train_step(ref.message(x, y))
            if b in (0, 7):
                s1.train_step(out)
        states = w.stage_states(ref)
    _assert_states(first["states"], states, 0)
    _assert_states(last["states"], states, 1)


@pytest.mark.slow
def test_a_stage_sends_its_output_before_its_backward_and_step(tmp_path):
    """Stage 0's first optimizer step waits until stage 1 began its forward on batch 0 (else a 20 s timeout)."""
    codes, text = _launch(2, "early", tmp_path)
    assert codes == [0, 0], text[-3000:]
    assert [json.loads((tmp_path / f"early-{r}.json").read_text())["steps"] for r in range(2)] == \
        [{"0": 3}, {"1": 3}]


@pytest.mark.slow
def test_a_momentum_head_pulls_whole_copies_sent_back_by_the_next_stage(tmp_path):
    """Stage 1 sends a copy of the block stage 0's head follows after every step (m = 0: the trunk becomes the copy);
    over 2 epochs with an evaluation between them, the trunk ends as exactly one of those copies. Stage 0 starts
    the second epoch's receiving thread only after the first one took the epoch's end marker, which stage 1 sends
    after its last copy of that epoch: so the trunk is that copy (the 6th) or a later one."""
    codes, text = _launch(2, "momentum", tmp_path)
    assert codes == [0, 0], text[-3000:]
    trunk = torch.load(tmp_path / "momentum-0.pt", weights_only=True)["trunk"]
    snapshots = torch.load(tmp_path / "momentum-1.pt", weights_only=True)["snapshots"]
    assert len(snapshots) == 12
    same = [k for k, snap in enumerate(snapshots) if all(torch.equal(a, b) for a, b in zip(trunk, snap))]
    assert same and same[0] >= 5


@pytest.mark.slow
def test_ranks_with_different_plans_are_refused(tmp_path):
    codes, text = _launch(2, "plans", tmp_path)
    assert codes == [0, 0], text[-3000:]
    for r in range(2):
        e = json.loads((tmp_path / f"plans-{r}.json").read_text())["text"]
        assert e == ("PPLLError: the processes compiled different plans: rank 0 cuts after ['blocks_0'], rank 1 "
                     "after ['blocks_1']. Plan once (e.g. plan.save('plan.json') on one process) and compile "
                     "with plan='plan.json' on every rank"), e


# ---- in one process ----------------------------------------------------------------------------------------

def _tiny() -> Any:
    torch.manual_seed(0)
    return ppll_compile.compile(w.Chain(2), 2, example_inputs=(torch.randn(4, 8),), policy="dgl")


def test_without_torchrun_the_error_says_how_to_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(PPLLError, match=r"torchrun --nproc-per-node=2"):
        _tiny().trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="distributed")


def test_world_size_must_match_the_stages(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        with pytest.raises(PPLLError, match=r"the plan has 2 stages, so it needs 2 processes; got world size 1 "
                                            r"\(launch with torchrun --nproc-per-node=2, or compile with gpus=1\)"):
            _tiny().trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), runtime="distributed")
    finally:
        dist.destroy_process_group()


# ---- torchrun and the example ------------------------------------------------------------------------------

TINY = ["--synthetic", "--epochs", "1", "--steps-per-epoch", "2", "--batch-size", "4"]


@pytest.mark.slow
def test_example_on_two_nodes(tmp_path):
    port = free_port()
    procs = [_start([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={n}",
                     "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}", str(EXAMPLE),
                     *TINY, "--checkpoint", str(tmp_path / "ckpt")]) for n in (0, 1)]
    outputs = _wait(procs, timeout=120)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    # the last stage's process (node 1) reports; both stages' losses reach it
    assert "final accuracy" in outputs[1] and "final accuracy" not in outputs[0], outputs[1][-3000:]
    assert "epoch 1/1: loss per stage s0 " in outputs[1] and " s1 " in outputs[1]
    assert (tmp_path / "ckpt" / "latest").read_text() == "ckpt-000000\n"
    assert (tmp_path / "ckpt" / "ckpt-000000" / "manifest.json").is_file()


@pytest.mark.slow
def test_example_with_torchrun_on_one_node():
    proc = _start([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                   f"--master-port={free_port()}", str(EXAMPLE), *TINY])
    out = _wait([proc], timeout=120)[0]
    assert proc.returncode == 0 and "final accuracy" in out, out[-3000:]
    assert out.count("final accuracy") == 1  # printed by the main process only


# ---- Pipe-BD, replicated stages, the DNA baseline ------------------------------------------------------

def _check_distill(tmp_path: Path, layout: str, world: int, stage_of_rank: list[int], ref: dict[str, Any]) -> None:
    for r in range(world):
        rec = torch.load(tmp_path / layout / f"rank-{r}.pt", weights_only=True)
        for key in ("after_steps", "final"):
            for stage in rec[key]:
                _assert_states(rec[key], ref[key], stage)
        assert set(rec["final"]) == ({stage_of_rank[r]} if layout != "one" else set(ref["final"]))
        assert rec["evaluation"]["samples"] == ref["evaluation"]["samples"] == 15
        assert rec["evaluation"]["block_loss"] == pytest.approx(ref["evaluation"]["block_loss"], rel=1e-5)


@pytest.mark.parametrize("layout,world,stage_of_rank", [("two", 2, [0, 1]), ("relay", 2, [0, 1]),
                                                        ("replicated", 3, [0, 0, 1])])
@pytest.mark.slow
def test_pipebd_equals_sequential_distillation(tmp_path, layout, world, stage_of_rank):
    # relay: decoupled=False; replicated: stage 0 on two processes, rank 0 sends the other its half of each batch
    codes, text = _launch(world, "distill", tmp_path, "distributed", layout)
    assert codes == [0] * world, text[-3000:]
    ref = w.distill_program(w.distill_pipeline("sequential", "two" if layout == "relay" else layout), tmp_path / "ref")
    _check_distill(tmp_path, layout, world, stage_of_rank, ref)
    if layout == "two":  # the distributed checkpoint resumes under the sequential runtime
        again = w.distill_pipeline("sequential", "two")
        again.load(tmp_path / "two" / "ckpt")
        _assert_states(w.stage_states(again), ref["after_steps"], 1)


@pytest.mark.slow
def test_a_failing_student_block_stops_every_process_with_its_error(tmp_path):
    codes, text = _launch(2, "distill-raise", tmp_path)
    assert codes == [1, 1], text[-3000:]
    for r, e in enumerate(_errors(tmp_path, 2)):
        assert e["type"] == "StageError"
        assert e["text"].startswith("stage 1 failed at batch 2: RuntimeError: student broke"), e["text"][:500]
        assert ("reported by stage 1" in e["text"]) == (r == 0)


@pytest.mark.slow
def test_dna_baseline_is_data_parallel_and_equals_sequential(tmp_path):
    codes, text = _launch(2, "distill", tmp_path, "dna", "one")
    assert codes == [0, 0], text[-3000:]
    ref = w.distill_program(w.distill_pipeline("sequential", "one"), tmp_path / "ref")
    _check_distill(tmp_path, "one", 2, [0, 0], ref)


@pytest.mark.slow
def test_a_replicated_ppll_stage_equals_sequential(tmp_path):
    codes, text = _launch(3, "replicated", tmp_path)
    assert codes == [0, 0, 0], text[-3000:]
    ref = w.replicated_program(w.replicated_chain("sequential"))
    for r, stage in enumerate([0, 1, 1]):
        rec = torch.load(tmp_path / f"replicated-{r}.pt", weights_only=True)
        _assert_states(rec["final"], ref["final"], stage)
        ours, theirs = rec["accuracy"], ref["accuracy"]
        assert {k: v for k, v in ours.items() if "loss" not in k} == {k: v for k, v in theirs.items() if "loss" not in k}
        # the replicas' slices of a batch each take their own mean loss: the same sum, in another order
        assert [ours["loss"], *ours["stage_loss"]] == pytest.approx([theirs["loss"], *theirs["stage_loss"]], rel=1e-6)
    assert torch.load(tmp_path / "replicated-1.pt", weights_only=True)["samples"] == ref["samples"] == [14]
    # every process gathers the same timeline: a lane per replica, each batch once, sends before receives
    timelines = [torch.load(tmp_path / f"replicated-{r}.pt", weights_only=True)["timeline"] for r in range(3)]
    assert timelines[0] == timelines[1] == timelines[2]
    spans: dict[tuple[int, int, str], list[tuple[int, float, float]]] = {}
    for stage, replica, batch, kind, start, end in timelines[0]:
        spans.setdefault((stage, replica, kind), []).append((batch, start, end))
    lanes = {(s, r) for s, r, _ in spans}
    assert lanes == {(0, 0), (1, 0), (1, 1)}
    for lane in lanes:
        assert [b for b, _, _ in spans[(*lane, "forward")]] == list(range(6))
    assert [b for b, _, _ in spans[(0, 0, "send")]] == list(range(6))
    for replica in (0, 1):
        received = spans[(1, replica, "receive")]
        assert [b for b, _, _ in received] == list(range(6))
        for (_, sent, _), (_, _, arrived) in zip(spans[(0, 0, "send")], received):
            assert sent <= arrived
