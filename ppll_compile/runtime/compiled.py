"""``compile_stages``: every stage's modules (its block and its auxiliary head) run their forwards under
``torch.compile``, equal to eager within float tolerance, or the stage is refused with the reason.

How it is done, and why:

- Each stage compiles its own modules' ``forward`` once; a runner swaps the compiled forwards in only while its
  own forwards run (:meth:`StageCompiler.active`), so the modules, their ``state_dict`` keys (no ``_orig_mod.``),
  the pipeline's own call (``pipe(x)``) and later trainers on the same modules stay eager.
- Every compiled forward is a private copy of the module's ``forward`` code: torch.compile keeps its compiled
  graphs per code object and stops compiling one after ``recompile_limit`` of them, which the stages of one model
  (each a ``Stage``, each head of one class) would otherwise share.
- Inductor draws random numbers with its own generator unless ``fallback_random`` is on; it is turned on, so that
  dropout and drop-path draw exactly what eager draws from the stage's seeded generators (:mod:`.rng`).
- A forward that fails compiled is run again eagerly: if eager fails too, that error is the model's and is raised
  as it is; if eager works, the stage is refused with a :class:`~ppll_compile.errors.PPLLError` that names the
  stage, the module, torch.compile's reason and the way out ``compile_stages=False``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import PPLLError

COMPILE_KEYS = ("backend", "mode", "options", "dynamic", "fullgraph")
"""The ``torch.compile`` keywords ``compile_stages={...}`` takes."""
_MISSING = object()


def compile_options(value: Any) -> dict[str, Any] | None:
    """The ``torch.compile`` keywords of the trainer's ``compile_stages=``: ``None`` for ``False`` (eager), inductor's
    defaults for ``True``, or a dict of :data:`COMPILE_KEYS` (e.g. ``{"mode": "max-autotune"}``,
    ``{"backend": "aot_eager"}``). With inductor, ``options["fallback_random"]`` is on unless the dict turns it off,
    so that dropout draws what eager draws (a ``mode`` becomes the inductor options it stands for)."""
    if value is False or value is None:
        return None
    if value is True:
        value = {}
    if not isinstance(value, Mapping):
        raise PPLLError(f"compile_stages must be True (every stage's forward under torch.compile), False (eager) or a "
                        f"dict of torch.compile keywords ({', '.join(COMPILE_KEYS)}), e.g. "
                        f"compile_stages={{'mode': 'max-autotune'}}; got {value!r}")
    unknown = sorted(repr(k) for k in value if k not in COMPILE_KEYS)
    if unknown:
        raise PPLLError(f"compile_stages got the key(s) {', '.join(unknown)}, which it does not pass to torch.compile; "
                        f"use only {', '.join(COMPILE_KEYS)}, e.g. compile_stages={{'mode': 'max-autotune'}}")
    options = dict(value)
    extra = options.get("options")
    if extra is not None and not isinstance(extra, Mapping):
        raise PPLLError(f"compile_stages['options'] must be a dict of inductor settings, e.g. "
                        f"{{'fallback_random': True}}; got {extra!r}")
    if _is_inductor(options):
        mode = options.pop("mode", None)
        options["options"] = {**_mode_options(mode), "fallback_random": True, **(extra or {})}
    return options


def _mode_options(mode: Any) -> dict[str, Any]:
    """The inductor options a torch.compile ``mode`` stands for (torch.compile takes a mode or options, not both)."""
    if mode is None:
        return {}
    modes = torch._inductor.list_mode_options()  # every mode by name (importing inductor takes seconds)
    if not isinstance(mode, str) or mode not in modes:
        raise PPLLError(f"compile_stages['mode'] must be one of {', '.join(map(repr, modes))} (a torch.compile "
                        f"mode), got {mode!r}")
    return dict(modes[mode])


def _is_inductor(options: Mapping[str, Any]) -> bool:
    return options.get("backend", "inductor") == "inductor"


def backend_name(options: Mapping[str, Any]) -> str:
    """The name of the backend torch.compile runs with ``options``."""
    backend = options.get("backend", "inductor")
    return backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend))


def cxx_compiler() -> str | None:
    """The path of the C++ compiler inductor builds CPU kernels with (``$CXX``, else ``g++``), if it is on ``PATH``."""
    return shutil.which(os.environ.get("CXX") or "g++")


def check_compilable(index: int, device: torch.device, options: Mapping[str, Any]) -> None:
    """Refuse, before stage ``index`` trains, what torch.compile cannot serve here: a Python that torch.compile does
    not run on, or inductor on a CPU without a C++ compiler."""
    if device.type == "cpu" and _is_inductor(options) and not os.environ.get("TORCH_INDUCTOR_INSTALL_GXX") \
            and cxx_compiler() is None:
        name = os.environ.get("CXX") or "g++"
        where = "$CXX" if os.environ.get("CXX") else "the default while $CXX is unset"
        raise PPLLError(f"compile_stages is on and stage {index} runs on the CPU, where torch.compile's inductor "
                        f"backend builds C++ kernels, but the C++ compiler {name!r} ({where}) is not on PATH; install "
                        f"one (e.g. apt-get install g++) or point CXX at one, pass "
                        f"compile_stages={{'backend': 'aot_eager'}} (compiled graphs without built kernels), or "
                        f"compile_stages=False (eager)")
    if not torch._dynamo.is_dynamo_supported():
        raise PPLLError(f"compile_stages is on, but torch.compile does not run on Python "
                        f"{'.'.join(map(str, sys.version_info[:3]))} with torch {torch.__version__}; pass "
                        f"compile_stages=False to train stage {index} eagerly")


def _own_code(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward`` made from a private copy of its code object (a plain function or a bound method), so that its
    compiled graphs are cached apart from every other module's."""
    func = getattr(forward, "__func__", forward)
    if not isinstance(func, types.FunctionType):
        return forward
    copy = types.FunctionType(func.__code__.replace(), func.__globals__, func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    copy.__dict__.update(func.__dict__)
    copy.__qualname__ = func.__qualname__
    bound = getattr(forward, "__self__", None)
    return types.MethodType(copy, bound) if bound is not None and forward is not func else copy


_ADVICE = ("Set TORCHDYNAMO_VERBOSE", "You can suppress", "For even more developer context", "Developer debug context",
           "from user code:", "For more information")


def reason(error: BaseException) -> str:
    """torch.compile's reason for ``error``, on one line: its message up to torch's advice on debugging."""
    lines = []
    for line in f"{type(error).__name__}: {error}".splitlines():
        if line.strip().startswith(_ADVICE):
            break
        if line.strip():
            lines.append(line.strip())
    text = " ".join(lines)
    return text if len(text) <= 400 else text[:397] + "..."


_COMPILER_DIRS = tuple(os.path.join("torch", d) + os.sep for d in ("_dynamo", "_functorch", "_inductor"))


def raised_by_compiler(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch.compile's machinery (dynamo, AOTAutograd, inductor): a backward
    compiled lazily, at its first call, fails there."""
    return any(f.f_code.co_filename.endswith(".py") and any(d in f.f_code.co_filename for d in _COMPILER_DIRS)
               for f, _ in traceback.walk_tb(error.__traceback__))


def backward_error(index: int, options: Mapping[str, Any], error: BaseException) -> PPLLError:
    """The error of a stage whose backward failed inside torch.compile (:func:`raised_by_compiler`)."""
    return PPLLError(f"stage {index}'s backward failed inside torch.compile (compile_stages is on, backend "
                     f"{backend_name(options)!r}): {reason(error)}; pass compile_stages=False to train it eagerly")


class CompiledForward:
    """One module's compiled ``forward``; a call that fails compiled tells torch.compile's failures from the model's.

    A failure compiled is followed by the same call eagerly: an eager failure is the model's own error and is raised
    as it is; an eager success means torch.compile cannot serve this module, and a :class:`PPLLError` names the
    stage, the module and the reason, with the way out ``compile_stages=False``.
    """

    def __init__(self, index: int, what: str, forward: Callable[..., Any], options: Mapping[str, Any]) -> None:
        self.index = index
        self.what = what
        self.eager = forward
        self.options = dict(options)
        try:
            self.compiled = torch.compile(_own_code(forward), **self.options)
        except Exception as e:  # torch.compile's own check of its keywords
            raise PPLLError(f"torch.compile refuses the keywords compile_stages gives it ({self.options!r}): "
                            f"{reason(e)}; pass compile_stages=True (inductor's defaults) or other keywords") from e

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.compiled(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - told apart below: the model's own error or torch.compile's
            failure = e
        self.eager(*args, **kwargs)  # the model's own error, if it is one, is raised here as eager raises it
        raise PPLLError(f"stage {self.index}'s {self.what} runs eagerly but not under torch.compile (compile_stages "
                        f"is on, backend {backend_name(self.options)!r}): {reason(failure)}; pass "
                        f"compile_stages=False to train it eagerly") from failure


class StageCompiler:
    """The compiled forwards of one stage's modules, swapped in for the modules' own while :meth:`active`."""

    def __init__(self, index: int, modules: Sequence[tuple[str, nn.Module]], device: torch.device,
                 options: Mapping[str, Any]) -> None:
        check_compilable(index, device, options)
        self.index = index
        self.options = dict(options)
        """The ``torch.compile`` keywords (see :func:`compile_options`)."""
        self._forwards = [(m, CompiledForward(index, what, m.forward, options)) for what, m in modules]
        recomputed = [what for what, m in modules if getattr(m, "checkpointed", 0)]
        if recomputed:
            warnings.warn(f"compile_stages: stage {index}'s {' and '.join(recomputed)} recomputes its forward in "
                          f"backward (checkpoint_activations=True), and torch.compile runs those training forwards "
                          f"eagerly (it does not trace their replay of the random numbers); its eval forwards and any "
                          f"auxiliary head run compiled. Plan with checkpoint_activations=False to compile its training "
                          f"forward, or pass compile_stages=False", stacklevel=2)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Calls of the stage's modules run their compiled forwards inside the block (in this thread and any other:
        a stage's modules are called by its own runner only); each module's earlier ``forward`` is restored after."""
        saved = [(m, m.__dict__.get("forward", _MISSING)) for m, _ in self._forwards]
        try:
            for m, forward in self._forwards:
                m.__dict__["forward"] = forward
            yield
        finally:
            for m, before in saved:
                if before is _MISSING:
                    m.__dict__.pop("forward", None)
                else:
                    m.__dict__["forward"] = before


def stage_compiler(index: int, modules: Sequence[tuple[str, nn.Module]], device: torch.device,
                   value: Any) -> StageCompiler | None:
    """The :class:`StageCompiler` of a stage's named ``modules`` when ``value`` (``compile_stages=``) asks for one."""
    options = compile_options(value)
    return None if options is None else StageCompiler(index, modules, device, options)
