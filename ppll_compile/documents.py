"""Reading the files users write (plans, policies, figures, checkpoints): a regular file read within a size limit
and never blocking on a FIFO or device, and YAML and JSON documents without quoting any of their content."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from collections.abc import Mapping
from typing import Any

import yaml


class NotRegular(Exception):
    """The path is a FIFO, device, socket or directory (:attr:`mode`: its ``st_mode``), not a regular file."""

    def __init__(self, mode: int) -> None:
        super().__init__(f"not a regular file (mode {mode:o})")
        self.mode = mode


class TooLarge(Exception):
    """The file holds more than the bytes it may: :attr:`size` by its ``stat``, ``None`` when it grew while read."""

    def __init__(self, size: int | None) -> None:
        super().__init__(f"too large ({size} bytes)" if size is not None else "grew while read")
        self.size = size


def read_regular(path: str | os.PathLike, most: int) -> bytes:
    """The bytes of the regular file ``path`` (links followed), which holds at most ``most``. A FIFO, device, socket
    or directory raises :class:`NotRegular` without being opened for reading (checked with ``stat`` first, then
    opened with ``O_NONBLOCK`` and checked again, so a file swapped in between cannot block); the size is checked
    before a byte is read, and a file that grew past ``most`` while read is refused (:class:`TooLarge`); a missing or
    unreadable file raises ``OSError``."""
    _fits(os.stat(path), most)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        size = _fits(os.fstat(fd), most)
        chunks, left = [], size + 1  # one byte more: a file grown since is refused, not cut short
        while left > 0 and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > most:
        raise TooLarge(None)
    return data


def _fits(info: os.stat_result, most: int) -> int:
    """The size of a regular file of ``info`` that holds at most ``most`` bytes; else :class:`NotRegular` or
    :class:`TooLarge`."""
    if not stat.S_ISREG(info.st_mode):
        raise NotRegular(info.st_mode)
    if info.st_size > most:
        raise TooLarge(info.st_size)
    return info.st_size



class LongNumber:
    """An integer in a document with more digits than Python converts from text
    (:func:`sys.get_int_max_str_digits`): read as its count of digits, so that the check of the option that holds
    it names the key (``heads.vector.hidden must be an integer from 1 to 1048576 ..., got an integer of 10,000
    digits``) instead of failing inside the reader."""

    def __init__(self, digits: int) -> None:
        self.digits = digits

    def __repr__(self) -> str:
        return f"an integer of {self.digits:,} digits"


def _too_long(digits: int) -> bool:
    limit = sys.get_int_max_str_digits()
    return bool(limit) and digits > limit


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, reading an integer too long for Python's text conversion as a :class:`LongNumber`."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    try:
        value = yaml.SafeLoader.construct_yaml_int(loader, node)
    except ValueError:  # the int-string conversion limit (a decimal integer of more than the limit's digits)
        return LongNumber(sum(c.isdigit() for c in str(node.value)))
    digits = int(abs(value).bit_length() * 0.30103) + 1  # a hexadecimal, octal or binary one converts freely
    return LongNumber(digits) if _too_long(digits) else value


_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def load_yaml(text: str) -> Any:
    """The YAML document ``text`` as :func:`yaml.safe_load` reads it, an integer too long for Python's text
    conversion read as a :class:`LongNumber` (so that it fails the check of its option, not the reader)."""
    return yaml.load(text, Loader=_Loader)  # a subclass of the safe loader


def _json_int(text: str) -> int | LongNumber:
    digits = sum(c.isdigit() for c in text)
    return LongNumber(digits) if _too_long(digits) else int(text)


def load_json(text: str) -> Any:
    """The JSON document ``text`` as :func:`json.loads` reads it, an integer too long for Python's text conversion
    read as a :class:`LongNumber`."""
    return json.loads(text, parse_int=_json_int)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'s' if n != 1 else ''}"


def described(value: Any) -> str:
    """What ``value`` (a parsed document or a part of one) is, without quoting any of it: an error about a file that
    may not be the kind expected at all says its kind and size, never its content."""
    if value is None:
        return "an empty document"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, LongNumber)):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return f"text of {_plural(len(value), 'character')}"
    if isinstance(value, list):
        return f"a list of {_plural(len(value), 'item')}"
    if isinstance(value, Mapping):
        return f"a mapping of {_plural(len(value), 'key')}"
    return f"a {type(value).__name__} value"


_TOKEN = re.compile(r"'<[a-z ]+>'|'(?:\\(?:x[0-9a-f]{2}|u[0-9a-f]{4}|.)|[^'\\])'")
"""What a YAML error may quote: the name of a syntax token (``'<block end>'``) or one character (``'\\t'``)."""


def _yaml_problem(problem: str) -> str:
    """A YAML reader's problem, without the names (anchors, aliases, tags) it quotes from the file."""
    return re.sub(r"'[^']*'", lambda m: m.group(0) if _TOKEN.fullmatch(m.group(0)) else "a name in the file",
                  problem)


def yaml_error(e: yaml.YAMLError) -> str:
    """``not valid YAML at line L, column C: <problem>``, from the reader's error ``e`` without the snippet of the
    file it carries (and without the names it quotes)."""
    mark = getattr(e, "problem_mark", None)
    at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None)
    return f"not valid YAML{at}" + (f": {_yaml_problem(problem)}" if problem else "")


def json_error(e: json.JSONDecodeError) -> str:
    """``not valid JSON at line L, column C: <what the reader expected>``, quoting nothing of the text."""
    return f"not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}"


def not_utf8(e: UnicodeDecodeError) -> str:
    """Which byte of a file is not UTF-8 text, quoting nothing else of it."""
    return f"byte {e.object[e.start]:#04x} at offset {e.start} is not UTF-8 text"


def _key(key: Any) -> str:
    if isinstance(key, str):
        return key
    return repr(key) if isinstance(key, (int, float, bool, LongNumber)) or key is None else described(key)


def long_number(document: Any) -> tuple[str, LongNumber] | None:
    """Where the first :class:`LongNumber` of ``document`` stands (``stages[0].head.config.width``, ``""`` for the
    document itself) and the number, or None where there is none. Walks without recursion, so any depth the
    readers accept is fine."""
    todo: list[tuple[str, Any]] = [("", document)]
    while todo:
        at, value = todo.pop()
        if isinstance(value, LongNumber):
            return at, value
        if isinstance(value, Mapping):
            items = [(f"{at}.{_key(k)}" if at else _key(k), v) for k, v in value.items()]
            items += [(f"{at} key" if at else "a key", k) for k in value if isinstance(k, LongNumber)]
        elif isinstance(value, list):
            items = [(f"{at}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        todo.extend(reversed(items))
    return None
