"""Pipe-BD's alignment: cut a teacher and a student at boundaries of equal shape, block by block."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.analyse import Analysis
from ..analysis.cuts import Cut
from ..errors import CutError
from ..plans.plan import TensorSpec


@dataclass(frozen=True, kw_only=True)
class Blocks:
    """Both traced models and the aligned block ends (indices into each side's cuts)."""

    teacher: Analysis
    """The frozen teacher, traced and measured."""
    student: Analysis
    """The student, traced and measured."""
    ends: list[tuple[int, int]]
    """Per block but the last: where it ends, as (teacher cut, student cut) indices."""
    notes: tuple[str, ...] = ()
    """What the plan should say about the alignment (student blocks merged for want of parameters)."""

    def nodes(self, k: int) -> tuple[list[Any], list[Any]]:
        """Teacher and student nodes of block ``k`` (placeholders and attribute reads dropped)."""
        out = []
        for a, side in ((self.teacher, 0), (self.student, 1)):
            first = self.ends[k - 1][side] + 1 if k > 0 else 0
            last = self.ends[k][side] if k < len(self.ends) else len(a.cuts)
            nodes = a.segment_nodes(first, last)
            out.append([n for n in nodes if n.op not in ("placeholder", "get_attr")] or nodes)
        return out[0], out[1]

    def cuts(self, side: int) -> list[Cut]:
        """The cuts where the blocks end: the teacher's (``side`` 0) or the student's (1)."""
        a = self.teacher if side == 0 else self.student
        return [a.cuts[e[side]] for e in self.ends]


def output_spec(a: Analysis) -> TensorSpec:
    """The model's output, which a ``pipebd`` plan needs to be one tensor."""
    spec = a.output_spec()
    if spec is None:
        raise CutError("a pipebd model must return one tensor (the block losses compare outputs); "
                       "wrap it to return its logits or features")
    return spec


def _shape(a: Analysis, cut: Cut) -> tuple[tuple[int, ...], ...]:
    """The shapes and dtypes of every value crossing ``cut``, main tensor first: a block boundary's signature.
    Side values (an attention mask) travel with the teacher's output to the next student block, so a teacher
    and a student boundary match when all of them agree."""
    return tuple((*v.shape, v.dtype) if i else tuple(v.shape) for i, v in enumerate(a.boundary(cut)))


def _text(shape: tuple[tuple[Any, ...], ...]) -> str:
    return " + ".join(str(list(v)) for v in shape)


def _candidates(a: Analysis) -> list[int]:
    """Indices of the cuts where a run of equal boundary signatures ends."""
    out = []
    for i, c in enumerate(a.cuts):
        nxt = a.cuts[i + 1] if i + 1 < len(a.cuts) else None
        if nxt is None or _shape(a, nxt) != _shape(a, c):
            out.append(i)
    return out


def _listing(a: Analysis, name: str) -> str:
    shown = [f"{a.cuts[i].node} {_text(_shape(a, a.cuts[i]))}" for i in _candidates(a)]
    return f"{name}: " + (", ".join(shown) or "none")


def _match(t: Analysis, s: Analysis) -> list[tuple[int, int]]:
    """The longest in-order matching of the two sides' candidate boundaries by signature (LCS)."""
    tc, sc = _candidates(t), _candidates(s)
    ts, ss = [_shape(t, t.cuts[i]) for i in tc], [_shape(s, s.cuts[i]) for i in sc]
    n, m = len(ts), len(ss)
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            best[i][j] = best[i + 1][j + 1] + 1 if ts[i] == ss[j] else max(best[i + 1][j], best[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if ts[i] == ss[j] and best[i][j] == best[i + 1][j + 1] + 1:
            pairs.append((tc[i], sc[j]))
            i, j = i + 1, j + 1
        elif best[i + 1][j] >= best[i][j + 1]:
            i += 1
        else:
            j += 1
    return pairs


def _named(t: Analysis, s: Analysis, blocks: Sequence[Sequence[str]]) -> list[tuple[int, int]]:
    """Cut indices of user-named ``(teacher, student)`` block ends, checked for order and matching shapes."""
    pairs = []
    for k, pair in enumerate(blocks):
        if not (isinstance(pair, Sequence) and not isinstance(pair, str) and len(pair) == 2):
            raise CutError(f"blocks[{k}] is {pair!r}; give (teacher_module, student_module) pairs naming where "
                           f"each block ends")
        try:
            ti = t.cut_index(pair[0])
        except CutError as e:
            raise CutError(f"blocks[{k}], teacher side: {e}") from None
        try:
            si = s.cut_index(pair[1])
        except CutError as e:
            raise CutError(f"blocks[{k}], student side: {e}") from None
        if _shape(t, t.cuts[ti]) != _shape(s, s.cuts[si]):
            raise CutError(f"blocks[{k}]: the teacher's output at {pair[0]!r} has shape "
                           f"{_text(_shape(t, t.cuts[ti]))} but the student's at {pair[1]!r} has "
                           f"{_text(_shape(s, s.cuts[si]))}; a student block learns the teacher's output, so the "
                           f"shapes must agree. Candidate boundaries with their shapes:\n  "
                           f"{_listing(t, 'teacher')}\n  {_listing(s, 'student')}")
        pairs.append((ti, si))
    for (t0, s0), (t1, s1) in zip(pairs, pairs[1:]):
        if not (t0 < t1 and s0 < s1):
            raise CutError(f"blocks must be given in model order on both sides; {blocks!r} is not")
    return pairs


def _ends(t: Analysis, s: Analysis, blocks: Sequence[Sequence[str]] | None
          ) -> tuple[list[tuple[int, int]], list[str]]:
    """The block ends as (teacher cut, student cut) index pairs, student blocks without parameters merged; and
    notes on the merges."""
    pairs = _named(t, s, blocks) if blocks is not None else _match(t, s)
    if not pairs and blocks is None:
        raise CutError(f"the teacher and the student share no boundary shape, so they cannot be cut into aligned "
                       f"blocks. Candidate boundaries with their shapes:\n"
                       f"  {_listing(t, 'teacher')}\n  {_listing(s, 'student')}\n"
                       f"Name the block ends with blocks=[(teacher_module, student_module), ...]")
    kept: list[tuple[int, int]] = []
    notes: list[str] = []
    start = 0
    for ti, si in pairs:
        if s.trains(s.segment_nodes(start, si)):
            kept.append((ti, si))
            start = si + 1
        else:
            notes.append(f"student block ending at {s.cuts[si].node!r} has no parameters; merged into the next")
    if kept and not s.trains(s.segment_nodes(start, len(s.cuts))):
        dropped = kept.pop()
        notes.append(f"the last student block has no parameters; merged with the one ending at "
                     f"{s.cuts[dropped[1]].node!r}")
    return kept, notes


def stage_ends(b: Blocks, split_points: Sequence[str]) -> list[int]:
    """Stage ends (in blocks) from student block ends named by hand."""
    ends = {si: k + 1 for k, (_, si) in enumerate(b.ends)}
    out = []
    for name in split_points:
        i = b.student.cut_index(name)
        if i not in ends:
            raise CutError(f"split_points: {name!r} is not where a block ends; a pipebd stage ends at a block end: "
                           f"{', '.join(repr(b.student.cuts[si].node) for _, si in b.ends)}")
        out.append(ends[i])
    if out != sorted(set(out)):
        raise CutError(f"split_points {list(split_points)} must name distinct block ends in model order")
    return out + [len(b.ends) + 1]


def align(t: Analysis, s: Analysis, blocks: Sequence[Sequence[str]] | None) -> Blocks:
    """The aligned blocks of teacher ``t`` and student ``s``: matched in order by boundary shape, or named with
    ``blocks=[(teacher_module, student_module), ...]``; student blocks without parameters are merged (noted)."""
    ends, notes = _ends(t, s, blocks)
    return Blocks(teacher=t, student=s, ends=ends, notes=tuple(notes))
