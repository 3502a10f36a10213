"""Advice worded for ``ppll-plan``: the library's errors and warnings name Python keyword arguments
(``split_points=[...]``, ``tied='untie'``, ``memory_limit=``); the command line words them as its flags.

:func:`cli_worded` rewrites every ``name=value`` whose ``name`` is a keyword of :func:`ppll_compile.plan` /
:func:`ppll_compile.compile` (their options included) into the flag the parser gives it (``--split-points A,B``,
``--tied untie``, ``--memory-limit``), its value in the flag's own syntax; a keyword with no flag is left as it is
and says where it is given instead (``build_teacher() in MODEL.py``, or ``in Python: ppll_compile.compile(...,
name=...)``). The table of flags comes from the parser itself, so a new flag is worded as soon as it exists.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
from typing import Any

from ..api import compile, plan
from ..options import PlanOptions

KEYWORDS = tuple(dict.fromkeys([f.name for f in dataclasses.fields(PlanOptions)]
                               + [n for f in (plan, compile) for n, p in inspect.signature(f).parameters.items()
                                  if p.kind is inspect.Parameter.KEYWORD_ONLY or n == "gpus"]))
"""The Python keyword arguments that advice may name: every plan option and every keyword of plan() and compile()."""

ELSEWHERE = {
    "teacher": "build_teacher() in MODEL.py (with --mode pipebd)",
    "example_inputs": "example_inputs() in MODEL.py",
    "example_kwargs": "example_inputs() in MODEL.py (its dict of keyword inputs)",
}
"""Where ``ppll-plan`` takes a keyword argument that no flag gives."""

VALUE_WORDS = {"replicas": {True: "auto", False: "none"}}
"""Python values a flag spells otherwise."""

_MENTION = re.compile(r"(?<![\w.\-/\\])(" + "|".join(sorted(KEYWORDS, key=len, reverse=True))
                      + r")(=|\b)(?!\.\w|[/\\])")  # not a part of a longer name or of a path
_ADVISING = re.compile(r"\b(drop|pass|set|raise|use|give|add|remove|lower|smaller|larger|or)\s+$", re.IGNORECASE)
"""The words after which a bare option name is advice (``drop split_points``, ``pass a smaller batch_size``)."""
_PYTHON_CALL = re.compile(r"ppll_compile\.\w+\(")
_UNIT = re.compile(r" ?(B|KiB|MiB|GiB|TiB)\b")
_CLOSE = {"[": "]", "(": ")", "{": "}"}


def flag_table(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's long options by their destination (``split_points`` -> the ``--split-points`` action)."""
    return {a.dest: a for a in parser._actions if any(s.startswith("--") for s in a.option_strings)}


def cli_worded(message: str, parser: argparse.ArgumentParser) -> str:
    """``message`` with its Python keyword-argument advice worded as ``parser``'s flags (see the module doc).
    Text inside an explicit ``ppll_compile.<function>(...)`` call is left as Python."""
    flags = flag_table(parser)
    out: list[str] = []
    i = 0
    while i < len(message):
        call = _PYTHON_CALL.match(message, i)
        if call:  # keep a Python call as written
            end = _closing(message, call.end() - 1)
            out.append(message[i:end])
            i = end
            continue
        m = _MENTION.match(message, i)
        if m is None:
            out.append(message[i])
            i += 1
            continue
        name, assigned = m.group(1), m.group(2) == "="
        if not assigned:  # a bare name is a flag as advice ("drop split_points") or as the subject the message
            # opens with, never as a key of a file ("plan.yaml: batch_size must be ...")
            advised = "_" in name and name in flags and (i == 0 or _ADVISING.search(message, 0, i))
            out.append(flag_name(flags[name]) if advised else name)
            i = m.end()
            continue
        raw, end = _value(message, m.end())
        out.append(_worded(name, raw, flags))
        i = end
    return "".join(out)


def flag_name(action: argparse.Action) -> str:
    """The action's long option, e.g. ``--split-points``."""
    return next(s for s in action.option_strings if s.startswith("--"))


def _worded(name: str, raw: str, flags: dict[str, argparse.Action]) -> str:
    """``name=raw`` as a flag with its value, or with where it is given when no flag gives it."""
    action = flags.get(name)
    if action is None:
        where = ELSEWHERE.get(name)
        if where is not None:
            return where
        return (f"{name}={raw} (in Python: ppll_compile.compile(..., {name}={raw or '...'}); ppll-plan has no flag "
                f"for it)")
    flag = flag_name(action)
    if not raw:
        return flag
    value = _cli_value(name, raw, action)
    return flag if value is None else f"{flag} {value}"


def _cli_value(name: str, raw: str, action: argparse.Action) -> str | None:
    """``raw`` (Python source, or a placeholder such as ``N`` or ``...``) in the flag's own syntax; ``None`` for a
    switch that takes no value."""
    if "..." in raw or raw.startswith("<"):  # a placeholder: say what the flag takes
        return action.metavar or name.upper()
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return action.metavar or name.upper() if raw[0] in _CLOSE else raw
    if isinstance(value, bool) or value is None:
        words = VALUE_WORDS.get(name, {})
        if value in words:
            return words[value]
        if action.nargs == 0:  # a switch: given or not
            return None
        return str(value).lower()
    if isinstance(value, (list, tuple)) and action.nargs == "+":  # --frozen a b
        return " ".join(map(str, value))
    if isinstance(value, (list, tuple)):
        return ",".join(":".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v) for v in value)
    return str(value)


def _value(text: str, start: int) -> tuple[str, int]:
    """The Python value written at ``text[start:]`` after ``name=`` and where it ends: a bracketed or quoted
    literal, ``...``, a number with its size unit (``1.5 GiB``), a bare word, or ``''``."""
    if start >= len(text):
        return "", start
    ch = text[start]
    if ch in _CLOSE:
        end = _closing(text, start)
        return text[start:end], end
    if ch in "'\"":
        end = text.find(ch, start + 1)
        end = len(text) if end < 0 else end + 1
        return text[start:end], end
    if text.startswith("...", start):
        return "...", start + 3
    if ch == "<":  # a placeholder such as <the frozen nn.Module>
        end = text.find(">", start)
        return (text[start:end + 1], end + 1) if end > 0 else ("", start)
    m = re.compile(r"[\w.:+\-]*").match(text, start)
    assert m is not None
    raw = m.group().rstrip(".:")
    end = start + len(raw)
    unit = _UNIT.match(text, end) if re.fullmatch(r"\d+(\.\d*)?", raw) else None
    if unit:
        return raw + unit.group(1), unit.end()
    return raw, end


def _closing(text: str, start: int) -> int:
    """The index after the bracket that closes the one at ``text[start]`` (quotes respected), or the text's end."""
    depth, quote = 0, None
    for j in range(start, len(text)):
        ch = text[j]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)
