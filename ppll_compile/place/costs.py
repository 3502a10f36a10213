"""The cost vectors a partitioner weighs, per unit of a plan (an atomic segment of a ``ppll`` plan, a block of a
``pipebd`` one), and the solvers' problems made from them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppll_compile import partitioners
from ppll_compile.partitioners.objective import Links, Segments
from ppll_compile.partitioners.replicas import ReplicaProblem

from ..options import PlanOptions


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What the partitioner weighs, per unit: an atomic segment of a ``ppll`` plan, a block of a ``pipebd`` one.

    Unit ``i`` ends at the cut after it; per-cut terms (``head*``, ``comm``) are paid by a stage ending there.
    """

    compute: list[float]
    """Forward and backward seconds at the full batch on one nominal device."""
    comm: list[float]
    """Seconds to send the boundary after the unit at the full batch inside a node (0 for the last unit)."""
    start: list[float] | None = None
    """``ppll``: seconds a stage starting at the unit saves: its input arrives detached, so its first layers
    compute no input gradient."""
    step: list[float] | None = None
    """Seconds of the optimizer step over the unit's parameters (part of ``compute``)."""
    head_step: list[float] | None = None
    """``ppll``: seconds of the optimizer step over the head's parameters (part of ``head``)."""
    memory: list[int]
    """Bytes of parameters, gradients, optimizer state and saved activations."""
    grad_bytes: list[int]
    """Bytes of gradients a replicated stage all-reduces."""
    head: list[float] | None = None
    """``ppll``: seconds of the auxiliary head at the cut after the unit."""
    head_memory: list[int] | None = None
    """``ppll``: bytes of that head."""
    head_grad_bytes: list[int] | None = None
    """``ppll``: bytes of that head's gradients (replicated with its stage)."""
    params: list[int] | None = None
    """``ppll``: parameter count (the ``params`` baseline partitioner balances it)."""
    split: list[list[float]] | None = None
    """Measured seconds at each share of the batch that ``2, 3, ...`` replicas train on (``profile="time"``)."""
    batch: int | None = None
    """Examples per training step (the plan's ``batch_size``): no stage runs on more replicas
    (:func:`~ppll_compile.partitioners.batch.most_replicas`); ``None``: no such cap."""
    recompute: list[float] | None = None
    """``checkpoint_activations``: seconds of the unit's forward that backward runs again (part of ``compute``)."""
    checkpoint_starts: list[int] | None = None
    """``checkpoint_activations``: the units where the model's checkpointed segments begin
    (:func:`~.checkpointing.checkpoint_starts`); a stage checkpoints those inside it, and one from its first unit."""

    def replica_problem(self, opts: PlanOptions, devices: int, cap: int | None) -> ReplicaProblem:
        """The exact replica partitioner's problem over ``devices``, each stage on at most ``cap`` of them, its sends
        and all-reduces over the links they cross."""
        opts.check_nodes(devices)
        links = opts.links()
        return ReplicaProblem(compute=self.compute, head=self.head, comm=self.comm, start=self.start,
                              grad_bytes=self.grad_bytes,
                              head_grad_bytes=self.head_grad_bytes, allreduce_bandwidth=links.intra,
                              memory=self.memory, head_memory=self.head_memory, memory_limit=opts.memory_limit,
                              devices=devices, max_replicas=cap, split_compute=self.split, batch=self.batch,
                              cross_comm=links.across(self.comm), gpus_per_node=links.gpus_per_node,
                              inter_node_bandwidth=links.inter if links.gpus_per_node else None)

    def problem(self, speeds: Sequence[float] | None, memory_limit: float | None,
                links: Links | None = None) -> partitioners.Problem:
        """The stage-count solvers' problem, stage ``j`` on device ``j`` of relative speed ``speeds[j]``, its send
        over the link it crosses (``links``: one node)."""
        links = links or Links()
        return partitioners.Problem(compute=self.compute, head=self.head, comm=self.comm, start=self.start,
                                    memory=self.memory, head_memory=self.head_memory, params=self.params,
                                    speeds=speeds, memory_limit=memory_limit, cross_comm=links.across(self.comm),
                                    gpus_per_node=links.gpus_per_node)

    def segments(self, links: Links | None = None) -> Segments:
        """The sums the stage-cost objective reads, as the solvers read them (so a plan's costs are theirs)."""
        return Segments.of(self.compute, head=self.head, comm=self.comm, start=self.start,
                           grad_bytes=self.grad_bytes, head_grad_bytes=self.head_grad_bytes, split=self.split,
                           cross_comm=(links or Links()).across(self.comm))
