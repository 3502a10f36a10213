"""Every column header the plan's tables print has a legend entry that says what it means and in which units."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ppll_compile
from ppll_compile.plans.table import FOOTER, LEGEND

X = torch.randn(4, 8)


def _mlp(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 16), nn.ReLU(), nn.Linear(16, 16),
                         nn.ReLU(), nn.Linear(16, 4))


@pytest.fixture(scope="module")
def plans() -> dict[str, ppll_compile.Plan]:
    """A plain ppll plan, one on nodes (its ``link`` column) and a pipebd plan (``teacher`` and the block table)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CPU fallback of a machine without GPUs
        return {
            "ppll": ppll_compile.plan(_mlp(), 2, example_inputs=(X,), profile="flops"),
            "nodes": ppll_compile.plan(_mlp(), 2, example_inputs=(X,), profile="flops", gpus_per_node=1),
            "pipebd": ppll_compile.plan(_mlp(8), 2, teacher=_mlp(32), mode="pipebd", example_inputs=(X,),
                                        profile="flops"),
        }


def _printed_headers(table: str) -> list[list[str]]:
    """The column headers of every table in ``table``: the line above each ``-----  ----`` rule, split at the
    two or more spaces between columns."""
    lines = table.splitlines()
    return [re.split(r" {2,}", lines[i - 1].strip()) for i, line in enumerate(lines)
            if i and re.fullmatch(r"-+( {2}-+)+", line)]


def _legend_entries(legend: str) -> dict[tuple[str, str], str]:
    """(table, column) -> meaning of every entry of ``legend``: a ``table:`` line, then ``  column  meaning``
    lines, a long meaning wrapped onto indented lines."""
    entries: dict[tuple[str, str], str] = {}
    table = key = None
    for line in legend.splitlines():
        if not line.startswith(" "):
            table = line.removesuffix(":")
        elif re.match(r"  \S", line):
            column, meaning = re.split(r" {2,}", line.strip(), maxsplit=1)
            key = (table, column)
            entries[key] = meaning
        else:
            entries[key] += " " + line.strip()
    return entries


@pytest.mark.parametrize("kind, tables", [("ppll", 2), ("nodes", 2), ("pipebd", 3)])
def test_every_printed_column_has_a_legend_entry(plans, kind, tables):
    plan = plans[kind]
    printed = _printed_headers(plan.table())
    assert len(printed) == tables
    entries = _legend_entries(plan.legend())
    names = list(dict.fromkeys(table for table, _ in entries))
    assert [[column for t, column in entries if t == table] for table in names] == printed  # exactly, in order
    assert all(entries[key] == LEGEND[key[0]][key[1]] for key in entries)


def test_the_legend_names_the_units(plans):
    entries = _legend_entries(plans["nodes"].legend())
    units = {"fwd": "(K, M, G, T = 10^3, 10^6, 10^9, 10^12)", "aux": "FLOPs per batch",
             "memory": "(KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes)", "params": "in millions (M = 10^6)",
             "cost ms": "predicted milliseconds of one step", "link": "intra (inside a node), node (to another node)"}
    for column, unit in units.items():
        assert unit in entries["stage table", column], column
    assert "in percent" in entries["memory table", "head % of step"]


def test_the_table_ends_with_a_pointer_to_the_legend_before_its_notes(plans):
    lines = plans["ppll"].table().splitlines()
    notes = [i for i, line in enumerate(lines) if line.startswith("note: ")]
    assert lines.index(FOOTER) == min(notes) - 1
    assert "ppll-plan --legend" in FOOTER and "plan.legend()" in FOOTER


def test_pipebd_columns_are_their_own(plans):
    legend = plans["pipebd"].legend()
    assert "  teacher" in legend.split("memory table:")[0] and "  aux " not in legend
    assert "block table:" in legend and "block table:" not in plans["ppll"].legend()


def test_the_docs_define_every_column_as_the_legend_does():
    page = (Path(__file__).resolve().parents[2] / "docs" / "cli.md").read_text()
    section = page.split("\n## The plan table\n", 1)[1].split("\n## ", 1)[0]
    parts = re.split(r"^(\w[\w ]*) table:$", section, flags=re.MULTILINE)[1:]  # name, its rows, name, ...
    documented = {f"{name.lower()} table": {m.group(1): m.group(2).replace("\\|", "|")
                                            for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", rows, re.MULTILINE)}
                  for name, rows in zip(parts[::2], parts[1::2])}
    assert documented == LEGEND
