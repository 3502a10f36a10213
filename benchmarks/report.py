"""Where benchmark results go: the date, machine and torch version they were measured on, as JSON, Markdown and PNG.

Every benchmark module offers ``section(quick=..., out=...) -> Section``: ``python -m benchmarks`` runs them all
into one ``results.json`` and ``results.md``; ``python -m benchmarks.<module>`` runs one alone (:func:`standalone`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

__all__ = ["Section", "environment", "write", "standalone"]


@dataclass(kw_only=True)
class Section:
    """What one benchmark measured: its results, a Markdown report and the PNG plots it wrote."""

    key: str
    """Key of the results in ``results.json`` (and the name of the files a standalone run writes)."""
    title: str
    """Heading of the section in ``results.md``."""
    results: dict[str, Any]
    """Everything measured, JSON-serialisable."""
    markdown: str
    """Tables and remarks, without the heading."""
    figures: list[str] = field(default_factory=list)
    """File names of the PNG plots written into the results folder."""

    def report(self) -> str:
        """The heading, the Markdown and links to the figures."""
        figures = "".join(f"\n![{self.title}: {f}]({f})\n" for f in self.figures)
        return f"## {self.title}\n\n{self.markdown.rstrip()}\n{figures}"


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


def standalone(section: Callable[..., Section], argv: list[str] | None, description: str | None) -> int:
    """``python -m benchmarks.<module> [--quick] [--out DIR]``: run one section, write ``<key>.json``/``.md``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few-minute version: fewer steps, rounds and models")
    parser.add_argument("--out", default="results", help="folder for the results and plots (default: results)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    s = section(quick=args.quick, out=out)
    write(out, s.key, {"environment": environment(), **s.results}, s.report())
    return 0
