"""A short CUDA check: stages equal the model, stage times vs the FLOP plan, the runtimes on the GPU, peak memory."""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import torch
import torchvision

import ppll_compile

from .runtime import stage_messages

__all__ = ["main"]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _train_throughput(fn, batch: int, device: str, steps: int = 10) -> float:
    for _ in range(3):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    _sync(device)
    return batch * steps / (time.perf_counter() - t0)


def _model(name: str, size: int) -> torch.nn.Module:
    return getattr(torchvision.models, name)(**({"image_size": size} if name.startswith("vit") else {}))


def _sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9)


def _runtime_rates(name: str, size: int, device: str, plan: ppll_compile.Plan, x: torch.Tensor,
                   y: torch.Tensor) -> tuple[dict[str, float], float]:
    """Samples/s of the sequential and threads runtimes (a worker and CUDA stream per stage, events between), and
    the largest difference of their trained parameters."""
    rates, params = {}, {}
    for runtime in ("sequential", "threads"):
        torch.manual_seed(0)
        fresh = _model(name, size)
        pipe = ppll_compile.compile(fresh.to(device), plan=plan, example_inputs=(x,))
        trainer = pipe.trainer(optimizer=_sgd, runtime=runtime)
        for _ in range(3):
            trainer.step(x, y)
        trainer.finish()
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(10):
            trainer.step(x, y)
        trainer.finish()
        _sync(device)
        rates[runtime] = x.shape[0] * 10 / (time.perf_counter() - t0)
        params[runtime] = [p.detach().float() for p in fresh.parameters()]
    drift = max((a - b).abs().max().item() for a, b in zip(params["sequential"], params["threads"]))
    return rates, drift


def _stage_peaks(compiled: ppll_compile.CompiledPipeline, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """Each stage's peak CUDA memory during a (second) training step, against the plan's figure."""
    trainer = compiled.trainer(optimizer=_sgd)
    msgs = stage_messages(trainer, x, y)  # running the stages also creates gradients and momentum buffers
    trainer.runners[-1].train_step(msgs[-1])
    peak = []
    for runner, msg, sp in zip(trainer.runners, msgs, compiled.plan.stages):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        runner.train_step(msg)
        state = [v for st in runner.optimizer.state.values() for v in st.values() if torch.is_tensor(v)]
        own = sum(t.numel() * t.element_size() for t in [*runner.params, *state])
        peak.append({"stage": runner.index, "peak_bytes": torch.cuda.max_memory_allocated() - base + own,
                     "planned_bytes": sp.memory_bytes})
    return peak


def check(name: str, batch: int, stages: int, device: str, size: int) -> dict:
    torch.manual_seed(0)
    model = _model(name, size).to(device)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    t0 = time.perf_counter()
    flops_plan = ppll_compile.plan(model, stages, example_inputs=(x,), devices=[device] * stages)
    plan_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    timed = ppll_compile.plan(model, example_inputs=(x,), plan=flops_plan, profile="time")
    time_plan_s = time.perf_counter() - t0
    compiled = ppll_compile.compile(model, plan=flops_plan, example_inputs=(x,))
    model.eval()
    with torch.no_grad():
        err = (compiled(x) - model(x)).abs().max().item()
    model.train()

    def step_model() -> None:
        model(x).sum().backward()

    rates, drift = _runtime_rates(name, size, device, flops_plan, x, y)
    return {
        "model": name, "batch": batch, "stages": stages, "max_abs_err_eval": err,
        "plan_seconds": plan_s, "time_profile_seconds": time_plan_s,
        "predicted_stage_share": [s.cost / flops_plan.sequential_cost for s in flops_plan.stages],
        "measured_stage_share": [s.cost / timed.sequential_cost for s in timed.stages],
        "measured_stage_ms": [s.cost * 1e3 for s in timed.stages],
        "measured_imbalance": timed.imbalance, "flops_imbalance": flops_plan.imbalance,
        "e2e_train_samples_per_s": _train_throughput(step_model, batch, device),
        "sequential_runtime_samples_per_s": rates["sequential"], "threads_runtime_samples_per_s": rates["threads"],
        "threads_vs_sequential_max_param_diff": drift,
        "stage_peak_memory": _stage_peaks(compiled, x, y) if device.startswith("cuda") else [],
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else device, "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="results", help="folder for gpu_check.json")
    parser.add_argument("--device", default="cuda:0", help="device to check (cpu for a dry run)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=224, help="input height and width")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.backends.cudnn.benchmark = True
    rows = [check(name, args.batch, 4, args.device, args.size) for name in ("resnet50", "vit_b_16")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
