"""Pictures of plans: per-stage cost bars, the traced graph coloured by stage with its cuts, and Gantt charts.

Every public function writes one file, its format chosen by the suffix (``.png``, ``.svg`` or ``.pdf``), and
returns a small frozen description of what it drew. matplotlib and graphviz are imported only when drawing.

Takes: a plan, a compiled pipeline or a timeline. Gives: one picture file each, and what it drew.

- :mod:`~ppll_compile.draw.figure`: the output path check, the figure and its saving, shared by all pictures.
- :mod:`~ppll_compile.draw.costs`: stacked cost bars per stage (:func:`plot_costs`).
- :mod:`~ppll_compile.draw.graph`: the traced graph by stage (:func:`describe_graph`, :func:`draw_graph`).
- :mod:`~ppll_compile.draw.gantt`: a timeline as one lane per stage replica (:func:`draw_gantt`).
"""

from __future__ import annotations

from .costs import plot_costs
from .gantt import draw_gantt
from .graph import draw_graph

__all__ = ["plot_costs", "draw_graph", "draw_gantt"]
