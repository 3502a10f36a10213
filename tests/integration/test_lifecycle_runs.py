"""A trainer's lifecycle: empty batches, close() after a failure, Ctrl-C, a trainer dropped without close(),
and one open trainer per compiled pipeline."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import os
from ppll_compile.errors import PPLLError
from tests import ckpt_worker as w
from tests.helpers import sgd

pytestmark = pytest.mark.usefixtures("one_thread_quietly")
ROOT = Path(__file__).resolve().parents[2]


# ---- Ctrl-C ------------------------------------------------------------------------------------------------
_CHILD = r"""
import json, signal, sys, threading, time
import torch
sys.path.insert(0, sys.argv[3])
import ppll_compile
from tests.dist_worker import Chain, Trap

torch.set_num_threads(1)
hung, managed = sys.argv[1] == "hung", sys.argv[2] == "with"
trap = Trap("sleep", 60.0 if hung else 0.2)
torch.manual_seed(0)
compiled = ppll_compile.compile(Chain(3, trap, 1), example_inputs=(torch.randn(4, 8),), policy="dgl",
                                split_points=["blocks.0", "blocks.1"], leaf_modules=(Trap,))
trap.armed = True
trainer = compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.01), runtime="threads", queue_depth=1)
received = []

def on_sigint(*_):
    received.append(time.monotonic())
    raise KeyboardInterrupt

signal.signal(signal.SIGINT, on_sigint)
x, y = torch.randn(4, 8), torch.randint(0, 4, (4,))
print("ready", flush=True)
try:
    if managed:
        with trainer:
            while True:
                trainer.step(x, y)
    else:
        while True:
            trainer.step(x, y)
except KeyboardInterrupt:
    seconds = time.monotonic() - received[0]
steps = dict(trainer.steps)
time.sleep(1.0)
alive = sorted(t.name for t in threading.enumerate() if t.name.startswith("ppll-stage") and t.is_alive())
try:
    trainer.step(x, y)
    after = "trained"
except Exception as e:
    after = f"{type(e).__name__}: {e}"
start = time.monotonic()
trainer.close()
print(json.dumps({"seconds": seconds, "alive": alive, "steps_before": steps, "steps_after": dict(trainer.steps),
                  "after": after, "close": time.monotonic() - start}), flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage,block", [("slow", "bare"), ("slow", "with"), ("hung", "with"), ("hung", "bare")])
def test_one_ctrl_c_stops_every_worker_within_a_second(stage, block):
    """A threads run whose middle stage is slow (0.2 s a batch) or hung (60 s) gets one SIGINT: the caller sees
    KeyboardInterrupt within a second, with or without ``with``, and every worker that is not stuck in its
    stage's own code has ended a second later, having trained nothing more."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, stage, block, str(ROOT)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    report = json.loads(out.strip().splitlines()[-1])
    assert report["seconds"] < 1.5 and report["close"] < 1.5, report
    assert report["alive"] == (["ppll-stage-1"] if stage == "hung" else []), report  # stuck in time.sleep(60)
    assert report["steps_after"] == report["steps_before"], report
    assert report["after"].startswith("PPLLError: this trainer was interrupted (KeyboardInterrupt) and its queued "
                                      "batches dropped; build a new trainer")


@pytest.mark.parametrize("bad", [-1, 0, 2**70, (os.cpu_count() or 1) + 1, True, 1.5])
def test_threads_per_stage_must_be_a_count_of_this_machines_cores(bad):
    compiled = w.pipeline()
    cores = os.cpu_count() or 1
    with pytest.raises(PPLLError) as e:
        compiled.trainer(optimizer=sgd, runtime="threads", threads_per_stage=bad)
    assert str(e.value) == (f"threads_per_stage must be None (this machine's {cores} cores shared out over the "
                            f"stages) or an integer from 1 to {cores} (the torch threads each stage's worker uses; "
                            f"more than the machine's cores only compete for them), got {bad!r}")
    with compiled.trainer(optimizer=sgd, runtime="threads", threads_per_stage=cores) as trainer:
        trainer.step(*w.batch(0))
    assert trainer.steps == {0: 1, 1: 1}


@pytest.mark.parametrize("bad", [-1, 0, -0.5, float("nan"), float("inf"), True, "1.0"])
def test_clip_grad_norm_must_be_a_positive_finite_number(bad):
    with pytest.raises(PPLLError) as e:
        w.pipeline().trainer(optimizer=sgd, clip_grad_norm=bad)
    assert str(e.value) == (f"clip_grad_norm must be None (no clipping) or a positive finite number (the largest "
                            f"gradient norm each stage keeps, e.g. 1.0), got {bad!r}; a negative bound would reverse "
                            f"the gradients and zero would erase them")
