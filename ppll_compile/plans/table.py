"""A plan printed as text: the stage table with its totals and notes, and a ``pipebd`` plan's block table."""

from __future__ import annotations

import textwrap

from .units import format_bytes, format_flops

_WIDTH = 110
"""Where the legend's lines wrap."""

_FLOPS = "FLOPs per batch at the planned batch size (K, M, G, T = 10^3, 10^6, 10^9, 10^12)"
_BYTES = "bytes on one device of the stage (KiB, MiB, GiB = 2^10, 2^20, 2^30 bytes)"

LEGEND: dict[str, dict[str, str]] = {
    "stage table": {
        "stage": "the stage's index, from 0; * marks the bottleneck, the stage with the largest cost ms, which sets "
                 "the pipeline's pace",
        "device": "the device the stage trains on; xN: N devices running it data-parallel (replicas), each on a "
                  "slice of the batch",
        "first": "the first module the stage runs (its module path, or the traced node's name outside any module)",
        "last": "the last module the stage runs: the cut after which its output goes to the next stage",
        "nodes": "how many nodes of the traced graph (one operation each: a module call, a function, a method) the "
                 "stage runs",
        "params": "the stage's own parameters in millions (M = 10^6), its auxiliary head's not counted",
        "fwd": f"the stage's forward: {_FLOPS}",
        "bwd": f"the stage's backward: {_FLOPS}",
        "aux": f"the auxiliary head's forward and backward together: {_FLOPS}; 0 on the last stage, which trains on "
               "the model's own output",
        "teacher": f"pipebd: the forward of the teacher blocks the stage runs: {_FLOPS}",
        "memory": f"the predicted peak: weights, gradients, optimizer state, saved activations and the head, in "
                  f"{_BYTES}; the memory table below splits it",
        "boundary": "the shape of every value the stage sends to the next one (batch first, dimensions joined by x, "
                    "several values joined by +; int: a number, not a tensor); - on the last stage",
        "link": "the link its boundary crosses: intra (inside a node), node (to another node); - on the last stage",
        "head": "the auxiliary head's type, as the policy chose it (e.g. mlp, conv); model on the last stage, "
                "which trains on the model's own output and loss; pipebd: the distillation losses of its blocks "
                "(e.g. mse+soft_ce)",
        "cost ms": "predicted milliseconds of one step of the stage (forward, backward, head, optimizer step and "
                   "sending its boundary) on its device, over its replicas",
    },
    "memory table": {
        "stage": "the stage's index, from 0",
        "weights": f"the stage's parameters, in {_BYTES}",
        "grads": "the gradients of its trained parameters, in the same units",
        "optimizer": "the optimizer's state for them (none for sgd, one copy for momentum, two for adam)",
        "activations": "what the stage's forward saves for its backward",
        "head": "the auxiliary head: its parameters, gradients, optimizer state, saved activations and scores with "
                "their gradient (its input not counted twice)",
        "teacher": "pipebd: the frozen teacher blocks the stage runs and the distillation losses",
        "logits": "the last stage's loss on the model's output: the output, what the loss saves and the output's "
                  "gradient",
        "memory": "the sum of the parts: the stage table's memory",
        "head % of step": "the share of the stage's cost ms spent in its head (the last stage: its loss), in percent",
    },
    "block table": {
        "block": "pipebd: the index of an aligned pair of teacher and student blocks, from 0",
        "stage": "the stage that trains the student block",
        "teacher ends at": "the teacher module whose output ends the block",
        "student ends at": "the student module whose output ends the block",
        "output": "the shape of the teacher's output of the block, which the student block learns (batch first)",
        "teacher fwd": f"the teacher block's forward: {_FLOPS}",
        "student fwd": f"the student block's forward: {_FLOPS}",
        "params": "the student block's parameters in millions (M = 10^6)",
        "loss": "the distillation loss and its options (e.g. mse; kl temperature=4.0)",
        "cost ms": "predicted milliseconds of the block: teacher forward, student forward, backward and step",
    },
}
"""What every column of :meth:`PlanTable.table`'s tables means, with its units, by table and column header."""

FOOTER = "columns: plan.legend() or ppll-plan --legend explains each (docs/cli.md, the plan table)"
"""The last line of the tables, before the notes: where their columns are explained."""


class PlanTable:
    """What :class:`~ppll_compile.plans.plan.Plan` prints (a base class, so the plan's own class stays about its data)."""

    def table(self) -> str:
        """The stage table and totals as plain aligned text."""
        nodes = self.gpus_per_node is not None
        header = self._headers()["stage table"]
        rows = []
        b = self.bottleneck_stage
        for s in self.stages:
            bnd = " + ".join("x".join(map(str, t.shape)) or "int" for t in s.boundary) or "-"
            head = s.head.config.get("type", "?") if s.head.kind != "model" else "model"
            rows.append([
                f"{s.index}{'*' if s.index == b else ''}",
                s.device + (f" x{s.replicas}" if s.replicas > 1 else ""), s.first_module or s.first_node,
                s.last_module or s.last_node, str(len(s.nodes)), f"{s.param_count / 1e6:.2f}M",
                format_flops(s.flops_fwd), format_flops(s.flops_bwd), format_flops(s.aux_flops),
                format_bytes(s.memory_bytes), bnd, *([_link(s)] if nodes else []), head, f"{s.cost * 1e3:.3f}",
            ])
        teacher = f" from teacher {self.teacher} ({len(self.blocks)} blocks)" if self.blocks else ""
        lines = [
            f"{self.mode.upper()} plan for {self.model}{teacher}: {len(self.stages)} stages on "
            f"{self.world_size} devices{self._nodes()}, batch {self.batch_size}, policy {self.policy}, partitioner "
            f"{self.partitioner}, profile {self.profile}",
            _aligned(header, rows, right={4, 5, 6, 7, 8, 9, 13 if nodes else 12}),
            f"bottleneck {self.bottleneck_cost * 1e3:.3f} ms (stage {b}, marked *)  "
            f"ideal {self.ideal_cost * 1e3:.3f} ms  imbalance {self.imbalance:.3f}  "
            f"predicted speedup {self.predicted_speedup:.2f}x over sequential "
            f"({self.sequential_cost * 1e3:.3f} ms)",
            f"{len(self.legal_cuts)} legal cuts; costs {self._cost_basis()}, "
            f"{self._links()}, optimizer {self.optimizer}, precision {self.precision}"
            + (", element-wise chains fused" if self.fusion == "fused" else "")
            + (f", memory limit {format_bytes(self.memory_limit)}" if self.memory_limit else ""),
        ]
        lines += ["", self.memory_table(), self._utilisation()]
        if self.blocks:
            lines += ["", self.block_table()]
        lines += [FOOTER, *(f"note: {n}" for n in self.notes)]
        return "\n".join(lines)

    def _headers(self) -> dict[str, list[str]]:
        """The column headers of every table this plan prints, by table (the keys of :data:`LEGEND`)."""
        headers = {
            "stage table": ["stage", "device", "first", "last", "nodes", "params", "fwd", "bwd",
                            "teacher" if self.blocks else "aux", "memory", "boundary",
                            *(["link"] if self.gpus_per_node is not None else []), "head", "cost ms"],
            "memory table": ["stage", "weights", "grads", "optimizer", "activations",
                             "teacher" if self.blocks else "head", "logits", "memory", "head % of step"],
        }
        if self.blocks:
            headers["block table"] = ["block", "stage", "teacher ends at", "student ends at", "output", "teacher fwd",
                                      "student fwd", "params", "loss", "cost ms"]
        return headers

    def legend(self) -> str:
        """What each column of the tables :meth:`table` prints means, with its units, one line per column."""
        lines = []
        for table, header in self._headers().items():
            width = max(map(len, header))
            lines.append(f"{table}:")
            lines += [textwrap.fill(LEGEND[table][column], _WIDTH, initial_indent=f"  {column.ljust(width)}  ",
                                    subsequent_indent=" " * (width + 4), break_on_hyphens=False) for column in header]
        return "\n".join(lines)

    def _nodes(self) -> str:
        """`` (N nodes of G)`` for a plan on nodes, else nothing."""
        g = self.gpus_per_node
        return "" if g is None else f" ({-(-self.world_size // g)} node{'s' if self.world_size > g else ''} of {g})"

    def _links(self) -> str:
        """The bandwidths the sends were priced at: one for every link, or inside and across nodes."""
        links = self.links()
        if self.gpus_per_node is None:
            return f"{format_bytes(links.intra)}/s links"
        return f"{format_bytes(links.intra)}/s links inside nodes, {format_bytes(links.inter)}/s across"

    def _cost_basis(self) -> str:
        if self.profile == "roofline":
            return f"in seconds of {self.calibration.get('device', 'the device')} (roofline, step included)"
        if self.profile == "time":
            return "measured on the device"
        return f"assume {format_flops(self.flops_per_second)}/s per device"

    def memory_table(self) -> str:
        """Per stage: the memory one of its devices holds by part (:func:`~ppll_compile.plans.report.memory_split`)
        and its head's share of its step time."""
        from .report import head_share, memory_split
        header = self._headers()["memory table"]
        rows = []
        for s in self.stages:
            m = memory_split(s)
            rows.append([str(s.index), *(format_bytes(x) for x in (m.weights, m.gradients, m.optimizer,
                                                                  m.activations, m.head, m.logits, m.total)),
                         f"{100 * head_share(s):.1f}"])
        return "memory per device by part\n" + _aligned(header, rows, right=set(range(1, len(header))))

    def _utilisation(self) -> str:
        """The line on the model FLOPs per step and the MFU at the predicted step time."""
        from .report import mfu, model_flops, peak_flops
        peak, rate = peak_flops(self), mfu(self, self.bottleneck_cost)
        flops = f"model FLOPs {format_flops(model_flops(self))} per step (backbone forward + backward, heads excluded)"
        if peak is None or rate is None:
            return f"{flops}; MFU unknown (the plan records no peak FLOP/s of its device)"
        per = format_flops(peak[0])
        per = f"{per[:-1]} {per[-1]}FLOP/s" if per[-1].isalpha() else f"{per} FLOP/s"
        return (f"{flops}; MFU {100 * rate:.3g}% at the predicted step time {self.bottleneck_cost * 1e3:.3f} ms on "
                f"{self.world_size} devices of {per} ({peak[1]})")

    def block_table(self) -> str:
        """``pipebd``: each block's teacher and student ends, the teacher output it learns, and its loss."""
        stage_of = {b: s.index for s in self.stages for b in s.blocks}
        header = self._headers()["block table"]
        rows = [[str(k.index), str(stage_of[k.index]), k.teacher_module or k.teacher_nodes[-1],
                 k.student_module or k.student_nodes[-1], "x".join(map(str, k.output.shape)),
                 format_flops(k.teacher_flops), format_flops(k.flops_fwd), f"{k.param_count / 1e6:.2f}M",
                 " ".join(f"{key}={v}" if key != "type" else str(v) for key, v in k.loss.items()),
                 f"{k.cost * 1e3:.3f}"] for k in self.blocks]
        return _aligned(header, rows, right={5, 6, 7, 9})

    def __str__(self) -> str:
        return self.table()


def _link(stage) -> str:
    """The table's ``link`` cell: ``node`` for a boundary sent to another node, ``intra`` inside one, ``-`` for
    none."""
    return "-" if stage.is_last else "node" if stage.crosses_nodes else "intra"


def _aligned(header: list[str], rows: list[list[str]], *, right: set[int]) -> str:
    """A text table: the header, a rule, the rows; columns in ``right`` right-aligned."""
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in [header, ["-" * w for w in widths], *rows])
