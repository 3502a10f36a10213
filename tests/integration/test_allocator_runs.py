"""The allocator setting: freed memory stays in the process (no page faults per step in worker threads), the
``PPLL_MALLOC=default`` opt-out and the environment's own settings are respected, and every runtime applies it."""

# Each property is measured in a fresh process (the allocator's state is per process and cannot be undone): the tests
# run this file as ``python tests/integration/test_allocator_runs.py START``, where START is ``none`` (nothing called),
# ``call`` (keep_freed_memory() called) or a runtime name (a trainer built with it), and read its JSON.

from __future__ import annotations

import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parents[1]
if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))

from ppll_compile.allocator import ENV, applied_setting, keep_freed_memory, other_allocator


def _glibc() -> bool:
    try:
        return sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError):
        return False


pytestmark = pytest.mark.skipif(not _glibc(), reason="the allocator setting acts on glibc (Linux) only")

CYCLES = 10
MANY = 1000
"""Faults per cycle that glibc's defaults take at the least (measured: 1,000 to 1,800 for these workloads)."""
FEW = 50
"""Faults per cycle allowed once the setting is applied (measured: 0)."""


def _faults_per_cycle(total_mib: int, block_mib: int) -> float:
    """Median minor faults of this thread per cycle of allocating ``total_mib`` MiB of tensors and freeing them."""
    import torch

    counts = []
    small: list[Any] = []
    for i in range(CYCLES + 2):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        blocks = [torch.ones(block_mib << 18) for _ in range(total_mib // block_mib)]
        small[:] = [torch.ones(1000) for _ in range(50)]  # small blocks that outlive the big ones, as a step's do
        del blocks
        if i >= 2:  # the first cycles size the heaps
            counts.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
    return statistics.median(counts)


def _in_thread(fn: Any, *args: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)))
    t.start()
    t.join()
    return out[0]


def _start_runtime(name: str) -> None:
    """Build a trainer with runtime ``name`` on a small model, train it on one batch and close it; nothing else touches
    the allocator."""
    import torch

    import ppll_compile
    from tests.models import conv_student, conv_teacher

    torch.manual_seed(0)
    x = torch.randn(4, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.startswith("dna"):
            compiled = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(x,),
                                            split_points=["5"], replicas=(1, 1))
        else:
            compiled = ppll_compile.compile(conv_student(), 2, example_inputs=(x,), split_points=["5"])
    trainer = compiled.trainer(optimizer=lambda p: torch.optim.SGD(p, lr=0.01), runtime=name)
    trainer.fit([(x, torch.zeros(4, dtype=torch.long))], progress=False)
    trainer.close()


def _worker(start: str) -> dict[str, Any]:
    """What the allocator looks like after ``start``, and the faults of worker threads made afterwards."""
    import torch

    torch.set_num_threads(1)
    out: dict[str, Any] = {"before": applied_setting() is not None}
    if start == "call":
        first = keep_freed_memory()
        again = keep_freed_memory()  # the same answer; once set, the very same object, and nothing set again
        out["idempotent"] = again == first and (again is first or not first.changed) \
            and applied_setting() is (first if first.changed else None)
        out["setting"] = {"applied": first.applied, "kept": first.kept, "reason": first.reason}
    elif start != "none":
        _start_runtime(start)
    out["after"] = applied_setting() is not None
    out["faults_41mib"] = _in_thread(_faults_per_cycle, 41, 1)
    out["faults_150mib"] = _in_thread(_faults_per_cycle, 150, 4)  # more than one heap of a thread's arena
    return out


def _run(start: str, **env: str) -> dict[str, Any]:
    """The worker's report from a fresh process whose environment adds ``env`` (PPLL_MALLOC and MALLOC_* cleared)."""
    base = {k: v for k, v in os.environ.items()
            if k != ENV and not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    base["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), start], env=base | env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_keeping_freed_memory_removes_the_faults_of_worker_threads() -> None:
    untouched = _run("none")
    kept = _run("call")
    assert kept["setting"]["applied"] and not kept["setting"]["reason"], kept
    for workload in ("faults_41mib", "faults_150mib"):
        assert untouched[workload] >= MANY, (workload, untouched)
        assert kept[workload] <= FEW, (workload, kept)


@pytest.mark.slow
def test_opt_out_leaves_glibc_untouched() -> None:
    out = _run("call", PPLL_MALLOC="default")
    assert not out["before"] and out["idempotent"]
    assert out["setting"] == {"applied": [], "kept": [], "reason": "PPLL_MALLOC=default"}
    assert not out["after"]
    assert out["faults_41mib"] >= MANY and out["faults_150mib"] >= MANY, out


@pytest.mark.slow
def test_the_environment_own_settings_are_kept() -> None:
    out = _run("call", MALLOC_TRIM_THRESHOLD_="4194304", GLIBC_TUNABLES="glibc.malloc.top_pad=131072")
    s = out["setting"]
    assert [n for n, _ in s["applied"]] == ["M_MMAP_THRESHOLD"]
    assert s["kept"] == [["M_TRIM_THRESHOLD", "MALLOC_TRIM_THRESHOLD_"],
                         ["M_TOP_PAD", "GLIBC_TUNABLES glibc.malloc.top_pad"]]


@pytest.mark.slow
def test_idempotent() -> None:
    out = _run("call")
    assert out["idempotent"] and not out["before"] and out["after"]


@pytest.mark.slow
def test_unknown_choice_says_the_way_out() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | {ENV: "fast"}
    env["PYTHONPATH"] = str(HERE.parent)
    code = "from ppll_compile.allocator import keep_freed_memory; keep_freed_memory()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "PPLL_MALLOC='fast' is not a known setting" in done.stderr and "PPLL_MALLOC=default" in done.stderr


@pytest.mark.slow
def test_another_allocator_is_left_alone(tmp_path: Path) -> None:
    maps = ("7f00-7f01 r-xp 00000000 08:01 1234 /usr/lib/x86_64-linux-gnu/libc.so.6\n"
            "7f02-7f03 r-xp 00000000 08:01 1235 /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert other_allocator(maps) == "libtcmalloc_minimal.so.4"
    assert other_allocator(maps.splitlines()[0] + "\n7f04-7f05 rw-p 00000000 00:00 0\n") is None
    # a library of that name preloaded into a fresh process (the real one when installed, else a stand-in)
    real = [p for p in ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "/usr/lib/libjemalloc.so.2") if Path(p).exists()]
    if real:
        lib = real[0]
    else:
        import ctypes.util
        z = ctypes.util.find_library("z")
        found = [p for p in (f"/usr/lib/x86_64-linux-gnu/{z}", f"/lib/x86_64-linux-gnu/{z}", f"/usr/lib/{z}")
                 if z and Path(p).exists()]
        if not found:
            pytest.skip("neither jemalloc nor libz to preload here")
        lib = str(tmp_path / "libjemalloc.so.2")
        shutil.copy(found[0], lib)
    out = _run("call", LD_PRELOAD=lib)
    assert out["setting"]["applied"] == [] and "libjemalloc.so.2 is loaded" in out["setting"]["reason"]


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["sequential", "threads", "dna"])
def test_a_runtime_start_applies_it(runtime: str) -> None:
    out = _run(runtime)
    assert not out["before"] and out["after"], out
    assert out["faults_41mib"] <= FEW and out["faults_150mib"] <= FEW, out


def test_every_runtime_starts_through_the_base(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every registered runtime trains through the trainer, which applies the setting before the first step of any
    runtime (a step or a whole fit), and only then: building a trainer leaves the allocator alone."""
    import torch

    import ppll_compile
    from ppll_compile.runtime import trainer as trainer_module
    from ppll_compile.runtime.base import Runtime
    from ppll_compile.runtime.distributed.runtime import DistributedRuntime
    from ppll_compile.runtime.dna import DNAPerBlockRuntime, DNARuntime
    from ppll_compile.runtime.registry import RUNTIME_CLASSES
    from ppll_compile.runtime.sequential import SequentialRuntime
    from ppll_compile.runtime.threads import ThreadsRuntime
    from tests.models import conv_student, conv_teacher

    def subclasses(c: type) -> set[type]:
        return {s for d in c.__subclasses__() for s in {d, *subclasses(d)}}

    found = subclasses(Runtime)
    assert {DistributedRuntime, SequentialRuntime, ThreadsRuntime, DNARuntime, DNAPerBlockRuntime} <= found
    assert set(RUNTIME_CLASSES.values()) <= found
    assert all(c.__new__ is object.__new__ for c in found), "a runtime allocates with a side effect"
    steps_then: list[int] = []
    trainers: list[Any] = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory",
                        lambda: steps_then.append(sum(r.steps for r in trainers[0].runners)))
    torch.manual_seed(0)
    x, y = torch.randn(4, 3, 16, 16), torch.zeros(4, dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ppll = ppll_compile.compile(conv_student(), 2, example_inputs=(x,), split_points=["5"])
        pipebd = ppll_compile.compile(conv_student(), teacher=conv_teacher(), example_inputs=(x,),
                                      split_points=["5"], replicas=(1, 1))
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    for name, compiled, by_step in [("sequential", ppll, True), ("threads", ppll, True), ("threads", ppll, False),
                                    ("dna", pipebd, True), ("dna-per-block", pipebd, False)]:
        steps_then.clear()
        trainers[:] = [compiled.trainer(optimizer=sgd, runtime=name)]
        assert steps_then == [], name
        if by_step:
            trainers[0].step(x, y)
            trainers[0].step(x, y)
        else:
            trainers[0].fit([(x, y), (x, y)], progress=False)
        trainers[0].close()
        assert steps_then == [0], (name, by_step, steps_then)  # once, before the first step


if __name__ == "__main__":
    print(json.dumps(_worker(sys.argv[1])))
