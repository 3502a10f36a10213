"""What ``compile`` returns: the plan with the modules it lowered to, callable like the model, and its trainer."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from .errors import PolicyError, PPLLError, TraceError
from .heads.policy import load_policy
from .heads.types import head_type_for
from .lower.stages import Lowered, Stage
from .plans.plan import Plan, TensorSpec
from .runtime import Trainer
from .runtime.messages import dtype_of


class CompiledPipeline:
    """A model compiled into pipeline stages: ``plan``, ``stages``, ``heads``; calling it runs the stages in order.

    The stages share the original model's parameter objects, so training them trains the model in place.
    """

    def __init__(self, *, model: nn.Module, graph_module: fx.GraphModule, plan: Plan, lowered: Lowered,
                 policy: Any = None, front: Mapping[str, Callable[..., Any]] | None = None):
        self.model = model
        self.graph_module = graph_module
        """The traced model the stages were split from."""
        self.plan = plan
        self.lowered = lowered
        """The modules the runtime trains (stages, heads, devices, the input binder)."""
        self.policy = policy
        """The policy the heads came from, when the caller gave it: a cut a trainer moves gets its head from it
        (``None``: the plan's policy, loaded by its name)."""
        self.front = front
        """``plan`` and ``compile``, the front door that made this pipeline, which a trainer moving a cut plans
        through again (``None``: its cuts cannot move)."""

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stage modules (``pipebd``: the student blocks), in order."""
        return self.lowered.modules

    @property
    def heads(self) -> tuple[nn.Module | None, ...]:
        """The auxiliary head of every stage; ``None`` for the last (the model's own output)."""
        return self.lowered.heads

    @property
    def devices(self) -> tuple[torch.device, ...]:
        """The device of every stage (its first replica's)."""
        return tuple(torch.device(d) for d in self.plan.devices)

    def train(self, mode: bool = True) -> CompiledPipeline:
        """Set the mode of every stage and head, and of the model: switch modes here rather than on the model
        alone, as operations captured inside the model's ``forward`` (functional dropout, attention dropout)
        follow their stage's mode."""
        self.model.train(mode)
        self.lowered.train(mode)
        return self

    def eval(self) -> CompiledPipeline:
        """Eval mode for every stage and head, and for the model."""
        return self.train(False)

    def stage_parameters(self, index: int) -> list[nn.Parameter]:
        """Parameters stage ``index`` trains: its backbone slice and its auxiliary head (``pipebd``: its blocks)."""
        return self.lowered.stage_parameters(self.plan.stages[index])

    def trainer(self, **options: Any) -> Trainer:
        """A :class:`~ppll_compile.runtime.Trainer` for this pipeline; ``options`` are its keyword arguments.

        ``optimizer`` (a factory ``fn(params) -> Optimizer``) is required; ``runtime`` is ``sequential``
        (default), ``threads`` or ``distributed``; ``loss=fn(output, target)`` is the last stage's loss (default: the
        task's: cross-entropy for class labels, BCE for 0/1 labels (bool, integer or float), MSE for other float targets;
        also the auxiliary heads' loss for every float target), ``aux_loss=fn(scores, target)`` (or one ``fn``/``None`` per auxiliary head)
        every head's local loss (see :class:`~ppll_compile.runtime.Trainer`). ``autocast=torch.bfloat16`` or
        ``torch.float16`` (with a gradient scaler per stage) runs the stages in mixed precision; ``accumulate=n`` steps
        every stage's optimizer once per ``n`` batches on their summed gradients. The trainer may move this pipeline's
        cuts (``rebalance=True``,
        :meth:`~ppll_compile.runtime.Trainer.replan`): :attr:`plan`, :attr:`lowered` and :attr:`graph_module`
        then follow it.
        """
        replanner = Replanner(self, options.get("rebalance_policy")) if self.plan.mode == "ppll" else None
        trainer = Trainer(self.plan, self.lowered, replanner=replanner, **options)
        trainer.model = self.model  # what model_state_dict() and save_model() give back
        return trainer

    def bind(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """The model inputs in stage 0's order, from a call with the model's own signature."""
        return self.lowered.inputs.bind(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.lowered(*args, **kwargs)

    def __repr__(self) -> str:
        name = f"{type(self).__name__}({type(self.model).__name__}, {len(self.plan.stages)} stages)"
        return f"{name}\n{self.plan.table()}"


class DistillPipeline(CompiledPipeline):
    """A teacher/student pair compiled into aligned blocks: ``plan``, ``teacher_blocks``, ``student_blocks``.

    The student blocks share the student's parameter objects, so training them trains the student in
    place; each block sits on its stage's device. Calling the pipeline runs the *student* blocks in order
    (the student's own output); the trainer trains each student block on the teacher's relayed activations.
    """

    def __init__(self, *, model: nn.Module, teacher: nn.Module, graph_module: fx.GraphModule, plan: Plan,
                 lowered: Lowered) -> None:
        super().__init__(model=model, graph_module=graph_module, plan=plan, lowered=lowered)
        self.teacher = teacher

    @property
    def teacher_blocks(self) -> tuple[Stage, ...]:
        """The frozen teacher's blocks, one per distillation block."""
        return self.lowered.teacher

    @property
    def student_blocks(self) -> tuple[Stage, ...]:
        """The student's blocks, one per distillation block."""
        return self.lowered.modules

    @property
    def losses(self) -> tuple[Any, ...]:
        """Each block's distillation loss, ``fn(student_out, teacher_out)``."""
        return self.lowered.losses

    @property
    def block_devices(self) -> tuple[torch.device, ...]:
        """The device of every block: its stage's (first replica's)."""
        return self.lowered.devices


@contextlib.contextmanager
def _seeded(seed: int | None) -> Iterator[None]:
    """Torch's default CPU generator seeded by ``seed`` in the body, restored afterwards (a no-op for ``None``)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield


class Replanner:
    """Plans a compiled ``ppll`` pipeline again with other cuts, and re-splits its stages: what a trainer needs to move
    a cut (``rebalance=True``, :meth:`~ppll_compile.runtime.Trainer.replan`).

    Planning goes through the front door, :func:`ppll_compile.plan` and :func:`ppll_compile.compile`: the pipeline's
    plan is re-applied with the moved cut (so it keeps its settings, devices and the heads at the other cuts, edited by
    hand or not), on the model traced as before (the same tracer, the modules the first capture kept opaque as leaf
    modules, example inputs of the plan's shapes). A head at a new cut is the one the policy gives there (``policy``,
    else the plan's policy by name), built with the default generator seeded as the trainer says. The stages and heads
    a move does not change stay the very modules they were; the changed stages hold the model's own parameter objects.
    """

    def __init__(self, pipeline: CompiledPipeline, policy: Any = None) -> None:
        self.pipeline = pipeline
        self.policy = policy if policy is not None else pipeline.policy
        """The policy a new cut's head comes from (``None``: the plan's, by name)."""
        self._fine: dict[tuple[str, ...], Plan] = {}
        self._plans: dict[tuple[tuple[str, ...], tuple[str, ...]], Plan] = {}

    def check(self) -> None:
        """Raise :class:`~ppll_compile.PPLLError` saying why this pipeline's cuts cannot move (if they cannot)."""
        plan = self.pipeline.plan
        why = None
        if plan.mode != "ppll":
            why = "a pipebd plan's stages are distillation blocks (re-plan it with blocks=... instead)"
        elif any(s.replicas > 1 for s in plan.stages):
            why = (f"stage(s) {[s.index for s in plan.stages if s.replicas > 1]} are replicated (compile without "
                   f"replicas to rebalance, or move the cuts by compiling again with split_points=...)")
        elif following := [t.name for s in plan.stages if (t := head_type_for(s.head.config)) and t.follows_next]:
            why = (f"a {following[0]} head follows the next stage's parameters (compile with another head type to "
                   "rebalance, or move the cuts by compiling again with split_points=...)")
        elif plan.untied:
            why = (f"stages train their own copies of a tied parameter ({', '.join(plan.untied)}), which a re-split "
                   "would copy afresh (move the cuts by compiling again with split_points=...)")
        elif self.pipeline.front is None:
            why = "it was not made by ppll_compile.compile (compile the model to move its cuts)"
        if why is not None:
            raise PPLLError(f"this pipeline's cuts cannot move: {why}")
        try:
            load_policy(self.policy if self.policy is not None else plan.policy)
        except PolicyError as e:
            raise PPLLError(f"a moved cut gets its head from the plan's policy {plan.policy!r}, which cannot be loaded "
                            f"by that name ({e}); pass rebalance_policy=<the policy the pipeline was compiled with: a "
                            f"shipped name, a policy file or the callable> to the trainer") from None

    def candidate(self, cuts: Sequence[str]) -> Plan:
        """The plan with the cuts ``cuts`` (node names among the plan's legal cuts, one per cut), costed afresh;
        raises as planning does (e.g. a :class:`~ppll_compile.PlanError` over the memory limit)."""
        key = (self.pipeline.plan.cuts, tuple(cuts))
        if key not in self._plans:
            self._plans[key] = self._front("plan", plan=self._edited(cuts))
        return self._plans[key]

    def recut(self, cuts: Sequence[str], *, seed: int | None, note: str | None = None) -> tuple[Plan, Lowered]:
        """Re-split the pipeline at ``cuts``; the new plan (with ``note`` added) and modules, which the pipeline then
        holds. Stages whose two cuts did not move and heads at cuts that did not move are kept as they are; the other
        stages are split afresh on their devices (moved parameters move with them), a new cut's head is built with
        the default generator seeded by ``seed``."""
        p = self.pipeline
        old_plan, old = p.plan, p.lowered
        self.candidate(cuts)  # planned and checked before anything changes
        with _seeded(seed):
            compiled = self._front("compile", plan=self._edited(cuts))
        k = old_plan.num_stages
        same = [a == b for a, b in zip(old_plan.cuts, compiled.plan.cuts)]
        kept = [(j == 0 or same[j - 1]) and (j == k - 1 or same[j]) for j in range(k)]
        new = compiled.lowered
        lowered = dataclasses.replace(
            new, modules=tuple(old.modules[j] if kept[j] else new.modules[j] for j in range(k)),
            heads=tuple(old.heads[j] if j < k - 1 and same[j] else new.heads[j] for j in range(k)))
        plan = compiled.plan if note is None else dataclasses.replace(compiled.plan, notes=(*compiled.plan.notes, note))
        p.graph_module, p.plan, p.lowered = compiled.graph_module, plan, lowered
        self._plans.clear()
        return plan, lowered

    def _edited(self, cuts: Sequence[str]) -> Plan:
        """The pipeline's plan with its stages ending at ``cuts``; a stage whose cut moved gets the policy's head."""
        plan = self.pipeline.plan
        heads = {s.last_node: s.head for s in self._fine_plan().stages[:-1]}
        stages = [s if c == s.last_node else dataclasses.replace(s, last_node=c, head=heads[c])
                  for s, c in zip(plan.stages, cuts)]
        return dataclasses.replace(plan, stages=(*stages, plan.stages[-1]))

    def _fine_plan(self) -> Plan:
        """A plan cut at every legal cut: the policy's head at each."""
        plan = self.pipeline.plan
        if plan.legal_cuts not in self._fine:
            n = len(plan.legal_cuts) + 1
            self._fine[plan.legal_cuts] = self._front(
                "plan", split_points=list(plan.legal_cuts), devices=[plan.devices[0]] * n, batch_size=plan.batch_size,
                num_classes=plan.num_classes, profile=plan.profile, optimizer=plan.optimizer,
                link_bandwidth=plan.link_bandwidth, flops_per_second=plan.flops_per_second)
        return self._fine[plan.legal_cuts]

    def _front(self, name: str, **options: Any) -> Any:
        """``ppll_compile.<name>(model, ...)`` with ``options`` and the capture's; a model whose own forward branches
        on ``self.training`` was compiled with ``bake_train_mode=True``, so it is planned so again."""
        assert self.pipeline.front is not None, "checked by check()"
        call = self.pipeline.front[name]
        options = {**self._capture(), **options, **({"share_plan": False} if name == "compile" else {})}
        try:
            return call(self.pipeline.model, **options)
        except TraceError as e:
            if "bake_train_mode" not in str(e):
                raise
            return call(self.pipeline.model, bake_train_mode=True, **options)

    def _capture(self) -> dict[str, Any]:
        """The options that trace the model as the pipeline's graph was traced, and the plan's policy."""
        plan, gm, binder = self.pipeline.plan, self.pipeline.graph_module, self.pipeline.lowered.inputs
        options: dict[str, Any] = {"policy": self.policy if self.policy is not None else plan.policy,
                                   "tracer": plan.tracer}
        if plan.tracer == "fx":
            options["leaf_modules"] = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_module"})
        values = [_example(s, i) for i, s in enumerate(plan.inputs)]
        params = binder.signature.parameters
        by_name = len(binder.names) == len(values) and all(
            n in params and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
            for n in binder.names)
        if by_name:
            options["example_kwargs"] = {**binder.fixed, **dict(zip(binder.names, values))}
        else:
            options["example_inputs"] = tuple(values)
            options["example_kwargs"] = dict(binder.fixed) or None
        return options


def _example(spec: TensorSpec, index: int) -> Any:
    """An example value of an input of ``spec``: normal floats, zero integers, a zero Python number."""
    kind = dtype_of(spec)
    if kind is None:
        return {"int": 0, "float": 0.0, "bool": False}[spec.dtype]
    if kind.is_floating_point:
        return torch.randn(tuple(spec.shape), dtype=kind, generator=torch.Generator().manual_seed(index))
    return torch.zeros(tuple(spec.shape), dtype=kind)
