"""The runtimes by name, and the trainer's options checked against what the chosen runtime declares it can do."""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..errors import PPLLError
from ..plans.plan import Plan
from ..plans.precision import precision_spec
from .base import Runtime
from .compiled import compile_options
from .distributed.runtime import DistributedRuntime
from .dna import DNAPerBlockRuntime, DNARuntime
from .sequential import SequentialRuntime
from .threads import ThreadsRuntime

__all__ = ["register", "runtime_names"]

RUNTIME_CLASSES: dict[str, type[Runtime]] = {
    "sequential": SequentialRuntime,
    "threads": ThreadsRuntime,
    "distributed": DistributedRuntime,
    "dna": DNARuntime,
    "dna-per-block": DNAPerBlockRuntime,
}
"""Every runtime a trainer can be built with, by the name ``compiled.trainer(runtime=...)`` takes; a runtime's
capabilities are its class attributes (see :class:`~.base.Runtime`)."""
QUEUES = ("fifo", "latest", "reuse")
"""The queue rules between stages (``queue=``)."""


def runtime_names(mode: str | None = None, where: Callable[[type[Runtime]], bool] = lambda c: True) -> list[str]:
    """The names of the runtimes that train plans of kind ``mode`` (any kind: ``None``) and satisfy ``where``, in
    the registry's order."""
    return [n for n, c in RUNTIME_CLASSES.items() if (mode is None or mode in c.modes) and where(c)]


RUNTIMES = tuple(runtime_names("ppll"))
"""The runtimes of a ``ppll`` plan; a ``pipebd`` plan also takes the DNA baselines (``dna``, ``dna-per-block``)."""


def register(name: str, cls: type[Runtime]) -> type[Runtime]:
    """Make ``cls`` (a :class:`~.base.Runtime` with its capabilities and ``build``) the runtime called ``name``."""
    if not (isinstance(cls, type) and issubclass(cls, Runtime)):
        raise TypeError(f"a runtime is a subclass of ppll_compile.runtime.base.Runtime, got {cls!r}")
    if name in RUNTIME_CLASSES and RUNTIME_CLASSES[name] is not cls:
        raise ValueError(f"runtime {name!r} is taken by {RUNTIME_CLASSES[name].__name__}; register {cls.__name__} "
                         f"under another name")
    RUNTIME_CLASSES[name] = cls
    return cls


def runtime_class(name: Any, plan: Plan) -> type[Runtime]:
    """The runtime called ``name``, if it trains ``plan``'s kind; else an error listing those that do."""
    choices = runtime_names(plan.mode)
    _check_choice("runtime", name, choices)
    return RUNTIME_CLASSES[name]


def _check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not known; choose one of {', '.join(choices)}")


def _quoted(names: Sequence[str], joint: str) -> str:
    """``"a", "b" and "c"`` (``joint``: and, or)."""
    quoted = [f'"{n}"' for n in names]
    return f" {joint} ".join([", ".join(quoted[:-1]), quoted[-1]] if len(quoted) > 1 else quoted)


def check_options(plan: Plan, *, runtime: str, queue: str, optimizer: Any, queue_depth: Any, loss: Any,
                  decoupled: bool, trace: Any, seed: Any, accumulate: Any = 1, rebalance: Any = False,
                  threads_per_stage: Any = None, clip_grad_norm: Any = None, timeout: Any = 300.0,
                  compile_stages: Any = False) -> type[Runtime]:
    """The trainer's options, each alone and together with the plan's kind and what the runtime declares; the
    runtime's class."""
    cls = runtime_class(runtime, plan)
    compile_options(compile_stages)  # True, False or a dict of torch.compile's keywords; refused with the way out
    _check_choice("queue", queue, QUEUES)
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a factory fn(params) -> torch.optim.Optimizer, e.g. "
                        f"lambda p: torch.optim.SGD(p, lr=0.1); got {optimizer!r}")
    if not (isinstance(queue_depth, int) and queue_depth >= 1):
        raise ValueError(f"queue_depth must be an integer >= 1, got {queue_depth!r}")
    if queue not in cls.queues:
        able = runtime_names(plan.mode, lambda c: queue in c.queues)
        why = "never waits" if not cls.pipelined else f"runs {', '.join(cls.queues)} queues only"
        raise ValueError(f'queue="{queue}" needs a pipelined runtime ({_quoted(able, "or")}); the {runtime} runtime '
                         f'{why}')
    if plan.mode == "pipebd" and loss is not None:
        raise ValueError("a pipebd plan trains on the distillation losses of its policy; drop loss= and "
                         "compile with policy=... (pipebd, mse, kl or your YAML file) instead")
    if not decoupled and (queue != "fifo" or not cls.pipelined):
        pipelined = runtime_names(plan.mode, lambda c: c.pipelined)
        raise ValueError(f'decoupled=False (a barrier of all the stages before every optimizer step) applies to the '
                         f'pipelined runtimes {_quoted(pipelined, "and")} with queue="fifo"')
    if not isinstance(trace, bool):
        raise TypeError(f"trace must be True or False, got {trace!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed must be an int (the seed of every stage's dropout and other training randomness) "
                        f"or None (draw from torch's global generator, unseeded); got {seed!r}")
    check_accumulate(accumulate, plan, rebalance=rebalance)
    check_bounds(threads_per_stage=threads_per_stage, clip_grad_norm=clip_grad_norm, timeout=timeout)
    return cls


MAX_TIMEOUT = 7 * 24 * 3600
"""The longest ``timeout=`` a trainer takes, in seconds (a week): beyond it a wait is a hang."""


def _positive(value: Any) -> bool:
    """A real number (not a bool), finite and above 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return False
    return value > 0 and (isinstance(value, numbers.Integral) or math.isfinite(value))


def check_bounds(*, threads_per_stage: Any = None, clip_grad_norm: Any = None, timeout: Any = 300.0) -> None:
    """The trainer's numeric options within their bounds: ``threads_per_stage`` ``None`` or an integer from 1 to the
    machine's cores (more torch threads than cores only compete for them), ``clip_grad_norm`` ``None`` or a positive
    finite number (a negative bound reverses the gradients, zero erases them), ``timeout`` a positive number of
    seconds up to :data:`MAX_TIMEOUT`."""
    cores = os.cpu_count() or 1
    if threads_per_stage is not None and not (isinstance(threads_per_stage, numbers.Integral) and _positive(
            threads_per_stage) and threads_per_stage <= cores):
        raise PPLLError(f"threads_per_stage must be None (this machine's {cores} cores shared out over the stages) or "
                        f"an integer from 1 to {cores} (the torch threads each stage's worker uses; more than the "
                        f"machine's cores only compete for them), got {threads_per_stage!r}")
    if clip_grad_norm is not None and not _positive(clip_grad_norm):
        raise PPLLError(f"clip_grad_norm must be None (no clipping) or a positive finite number (the largest gradient "
                        f"norm each stage keeps, e.g. 1.0), got {clip_grad_norm!r}; a negative bound would reverse the "
                        f"gradients and zero would erase them")
    if not (_positive(timeout) and timeout <= MAX_TIMEOUT):
        raise PPLLError(f"timeout must be a positive number of seconds up to {MAX_TIMEOUT} (a week; how long a process "
                        f"waits for the others, and a new trainer for a previous one's worker threads), got "
                        f"{timeout!r}")


def check_accumulate(accumulate: Any, plan: Plan, *, rebalance: Any = False) -> None:
    """``accumulate`` (batches per optimizer step): an integer >= 1; above 1 for ``ppll`` plans without
    ``rebalance=True``."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise PPLLError(f"accumulate must be an integer >= 1 (the batches whose gradients every stage adds up before "
                         f"one optimizer step; 1: a step per batch), got {accumulate!r}")
    if accumulate > 1 and plan.mode == "pipebd":
        raise PPLLError(f"accumulate={accumulate} applies to ppll plans; a pipebd plan's blocks step once per batch: "
                         f"drop accumulate= and raise the batch size (or lower the learning rate) instead")
    if accumulate > 1 and rebalance is True:
        raise PPLLError(f"rebalance=True moves cuts between two batches, which would split an accumulation group "
                         f"(accumulate={accumulate}); drop one of them (rebalance with accumulate=1, save the plan "
                         f"with trainer.plan.save(...), and train it with accumulate=)")


def aux_loss_per_head(value: Any, plan: Plan) -> tuple[Callable[..., Any] | None, ...]:
    """The ``aux_loss`` option as one loss-or-None per auxiliary head (stages but the last); empty: the task's loss
    everywhere."""
    if value is None:
        return ()
    if plan.mode == "pipebd":
        raise PPLLError("aux_loss= sets the local loss of a ppll plan's auxiliary heads, but a pipebd plan trains on "
                        "the distillation losses of its policy; drop aux_loss= (compile with policy=... to change "
                        "them)")
    n = plan.num_stages - 1
    wanted = (f"aux_loss must be None (the task's loss), a callable fn(scores, target) -> scalar tensor for every "
              f"auxiliary head, or a list of {n} entries (one per auxiliary head: stages 0 to {n - 1}), each None or "
              f"such a callable")
    if callable(value):
        return (value,) * n
    if not isinstance(value, (list, tuple)):
        raise PPLLError(f"{wanted}; got {value!r}")
    if len(value) != n:
        raise PPLLError(f"{wanted}; got {len(value)} entries")
    bad = [k for k, v in enumerate(value) if v is not None and not callable(v)]
    if bad:
        raise PPLLError(f"{wanted}; entry {bad[0]} is {value[bad[0]]!r}, not callable")
    return tuple(value)


def _dtype_text(value: Any) -> str:
    """``torch.bfloat16`` for a dtype, ``None``, or a per-stage list as given."""
    return repr(value) if not isinstance(value, (list, tuple)) else f"[{', '.join(map(repr, value))}]"


def autocast_per_stage(value: Any, plan: Plan) -> tuple[torch.dtype | None, ...]:
    """The dtype every stage of ``plan`` trains under ``torch.autocast`` in (empty: none anywhere): the plan's
    precision's (:attr:`~ppll_compile.plans.precision.Precision.autocast`) when ``value`` is ``None``. A ``bf16``, ``fp16``
    or ``bf16-pure`` plan takes only its own dtype (its costs, memory and boundaries are priced in it); any other
    ``value`` is refused, naming both and the way out. An ``fp32`` plan takes a dtype, or one dtype-or-None per
    stage, as before precisions were planned, with a warning that its costs are float32's."""
    n = plan.num_stages
    precision = precision_spec(plan.precision)
    own = precision.autocast
    if own is not None:
        if value is None or value == own or (isinstance(value, (list, tuple)) and list(value) == [own] * n):
            return (own,) * n
        raise PPLLError(f"autocast={_dtype_text(value)} conflicts with the plan's precision {plan.precision!r}, whose "
                        f"costs, memory and boundaries are priced in {precision.dtype} and whose stages train under "
                        f"torch.autocast({own!r}); drop autocast= (it follows the plan), or re-plan with the "
                        f"precision you mean (precision='fp32', 'bf16' or 'fp16')")
    if value is None:
        return ()
    if isinstance(value, torch.dtype):
        dtypes: tuple[torch.dtype | None, ...] = (value,) * n
    elif isinstance(value, Sequence) and len(value) == n and all(v is None or isinstance(v, torch.dtype)
                                                                   for v in value):
        dtypes = tuple(value)
    else:
        raise ValueError(f"autocast must be a dtype (e.g. torch.bfloat16), None, or one dtype-or-None per stage "
                         f"({n} stages); got {value!r}")
    integral = [d for d in dtypes if d is not None and not d.is_floating_point]
    if integral:
        raise PPLLError(f"autocast={_dtype_text(value)} is not a floating-point dtype: torch.autocast runs a stage's "
                        f"forward in a lower float precision, and {integral[0]!r} holds no fractions; pass "
                        f"autocast=torch.bfloat16 or torch.float16 (or None: float32)")
    low = sorted({str(d).removeprefix("torch.") for d in dtypes if d is not None and d != torch.float32})
    if low:
        name = {"bfloat16": "bf16", "float16": "fp16"}.get(low[0], low[0])
        warnings.warn(f"autocast={_dtype_text(value)} trains a plan priced in float32 (precision 'fp32'): its costs, "
                      f"memory and boundaries are float32's; plan with precision={name!r} and drop autocast= (it "
                      f"follows the plan)", stacklevel=3)
    return dtypes


def check_pure(plan: Plan, stages: Sequence[Sequence[tuple[str, Tensor]]]) -> None:
    """A pure-precision plan trains parameters already in its dtype: refuse float32 ones in any stage (``stages``: the
    named parameters of every stage), naming the first and the ways out."""
    precision = precision_spec(plan.precision)
    if not precision.pure:
        return
    for i, named in enumerate(stages):
        for name, p in named:
            if p.is_floating_point() and str(p.dtype).removeprefix("torch.") != precision.dtype:
                raise PPLLError(f"the plan's precision {plan.precision!r} trains {precision.dtype} parameters, but "
                                f"stage {i} holds {str(p.dtype).removeprefix('torch.')} ones ({name!r}); cast the "
                                f"model with model.to(torch.{precision.dtype}) and feed {precision.dtype} inputs, or "
                                f"re-plan with precision='bf16' (mixed precision: float32 weights)")
