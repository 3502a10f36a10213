"""A plan printed as text: the stage table with its totals and notes, and a ``pipebd`` plan's block table."""

from __future__ import annotations

from .units import format_bytes, format_flops


class PlanTable:
    """What :class:`~ppll_compile.plans.plan.Plan` prints (a base class, so the plan's own class stays about its data)."""

    def table(self) -> str:
        """The stage table and totals as plain aligned text."""
        nodes = self.gpus_per_node is not None
        header = ["stage", "device", "first", "last", "nodes", "params", "fwd", "bwd",
                  "teacher" if self.blocks else "aux",
                  "memory", "boundary", *(["link"] if nodes else []), "head", "cost ms"]
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
        lines += [f"note: {n}" for n in self.notes]
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
        header = ["stage", "weights", "grads", "optimizer", "activations", "head" if not self.blocks else "teacher",
                  "logits", "memory", "head % of step"]
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
        header = ["block", "stage", "teacher ends at", "student ends at", "output", "teacher fwd", "student fwd",
                  "params", "loss", "cost ms"]
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
