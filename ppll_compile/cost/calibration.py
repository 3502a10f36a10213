"""Calibration as a step of its own: measure a device's roofline figures, cache them, and write a file to pin."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import torch

from ..errors import PlanError
from .roofline import FIGURES_ENV, DeviceFigures, cache_path, device_figures, device_memory, stage_threads


def calibrate(device: str | torch.device = "cpu", threads: int | None = None, refresh: bool = False, *,
              stages: int = 1, out: str | Path | None = None) -> DeviceFigures:
    """The roofline figures of ``device``, measured now unless cached (``refresh=True``: measured again, replacing
    the cached ones and their per-shape operator times), and cached for every later plan on this machine.

    ``threads``: the intra-op threads a stage computes on (a CPU's figures are cached per thread count); by default
    a CPU's share when ``stages`` stages share it (``cores // stages``, as a plan with ``gpus=stages`` gives each
    stage), 1 on a GPU. ``out``: also write the figures to this JSON file, to pin with ``PPLL_DEVICE_FIGURES=out``
    (the same figures for every plan, on any machine). The figures record the machine's load while measuring, and
    a warning says when it was busy (:data:`~ppll_compile.cost.figures.BUSY_LOAD`). ``PPLL_DEVICE_FIGURES`` does not
    stop a calibration, but while it is set plans use the file it names. ``ppll-plan --calibrate`` and
    ``--recalibrate`` do the same from the command line.
    """
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"cannot calibrate {dev}: this machine has no CUDA device; calibrate device='cpu', or run "
                        f"on the machine that will train")
    for name, value in (("threads", threads), ("stages", stages)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"calibrate needs {name} to be a positive integer, got {value!r}")
    if out is not None:
        _writable(out)  # refused before measuring
    figures = device_figures(dev, threads if threads is not None else stage_threads(dev, stages), refresh=refresh,
                             pinned=False)
    if out is not None:
        data = {k: v for k, v in figures.to_dict().items() if k != "source"}
        if data.get("memory_bytes") is None:  # cached by a version that did not record it
            data["memory_bytes"] = device_memory(dev)
        try:
            Path(out).write_text(json.dumps(data, indent=1) + "\n")
        except OSError as e:
            raise PlanError(f"cannot write the device figures to {str(out)!r}: {e.strerror or e}; pass a writable "
                            f"path") from None
    return figures


def _writable(out: str | Path) -> None:
    """Refuse an ``out`` that exists and is no regular file: writing to a FIFO with no reader blocks for ever, and a
    device is no file to pin."""
    try:
        mode = os.stat(out).st_mode
    except OSError:
        return  # not there yet (or not to be looked at: the write says why)
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: the write says so
        raise PlanError(f"cannot write the device figures to {str(out)!r}: not a regular file (a FIFO or device); "
                        f"pass out= (--figures) the path of a JSON file to write")


def summary(figures: DeviceFigures) -> str:
    """What a calibration did, in a few lines: the figures, where they are kept, the load while measuring, and how
    to measure them again or pin them."""
    measured = figures.source == "measured"
    head = (f"measured the figures of {figures.device}" if measured else
            f"the figures of {figures.device} are cached (measured before; --recalibrate measures them again)")
    load = figures.load_per_core()
    lines = [f"{head}: {figures.rate('matmul', 'float32') / 1e9:.0f} GFLOP/s matmul, "
             f"{figures.rate('conv', 'float32') / 1e9:.0f} GFLOP/s conv, "
             f"{figures.rate('memory', 'float32') / 1e9:.0f} GB/s memory, {figures.overhead * 1e6:.1f} us per "
             f"operator; " + (f"load {load:.2f} per core over {figures.load['cores']:.0f} cores while measuring"
                              + (" (busy)" if figures.busy() else "") if load is not None else
                              "the load while measuring is unknown"),
             f"cached in {cache_path()}"]
    pinned = os.environ.get(FIGURES_ENV)
    if pinned:
        lines.append(f"note: {FIGURES_ENV}={pinned} pins the figures every plan uses; unset it for plans to use "
                     f"these")
    return "\n".join(lines)
