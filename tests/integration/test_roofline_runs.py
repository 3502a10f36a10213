"""The roofline cost model: operator records, device figures and their cache, and the accounting it feeds."""

from __future__ import annotations

import torch

from ppll_compile.cost import roofline


def test_calibration_measures_every_family() -> None:
    fig = roofline.measure_device(torch.device("cpu"), 1)
    assert fig.device == roofline.device_name(torch.device("cpu"), 1) and fig.device.endswith("x1 thread")
    assert sorted(k.split(":")[0] for k in fig.rates) == sorted(roofline.FAMILIES)
    assert all(v > 0 for v in fig.rates.values()) and 0 < fig.overhead < 1e-3


def test_calibrated_rates_are_counted_work_over_the_measured_time() -> None:
    # a clock that advances 2**-10 s per reading: every timed run lasts exactly one tick, so a rate times the tick
    # is the work counted for the family's representative operator, FLOPs for a compute family, bytes otherwise
    tick = 2.0 ** -10
    readings = iter(range(10**9))
    fig = roofline.measure_device(torch.device("cpu"), 1, clock=lambda: next(readings) * tick)
    counted = {f: fig.rates[f"{f}:float32"] * tick for f in ("matmul", "conv", "conv_bwd", "memory", "step")}
    assert counted == {
        "matmul": 2 * 512 ** 3,  # 512x512 @ 512x512
        "conv": 2 * (16 * 128 * 16 * 16) * (128 * 3 * 3),  # every output element: 128 x 3 x 3 multiply-adds
        "conv_bwd": 2 * 2 * (16 * 128 * 16 * 16) * (128 * 3 * 3),  # the input's and the weight's gradients
        "memory": 3 * 32 * 64 * 32 * 32 * 4,  # h + h: reads two 8 MiB tensors, writes one
        "step": 5 * 8 * 2 ** 20 * 4,  # momentum SGD: 5 passes over 32 MiB of parameters
    }
    assert fig.overhead == tick / 200
