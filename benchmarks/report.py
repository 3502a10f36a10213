"""Where benchmark results go: the date, machine and torch version they were measured on, as JSON and Markdown."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "write"]


def environment(threads: str | None = None) -> dict[str, Any]:
    """``date``, ``machine`` (CPU count or GPU, and ``threads`` if given) and ``torch`` of this run."""
    device = f"CUDA {torch.cuda.get_device_name()}" if torch.cuda.is_available() else "no GPU"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, {device}" + (f", {threads}" if threads else "")
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "machine": machine, "torch": torch.__version__}


def write(folder: str | Path, name: str, results: dict[str, Any], markdown: str) -> None:
    """Write ``name.json`` and ``name.md`` into ``folder`` and print the Markdown."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
