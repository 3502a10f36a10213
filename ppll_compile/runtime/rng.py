"""Training randomness per stage: one seed per (seed, stage, batch, replica), and the forward run under it.

Dropout and drop-path take no generator: they draw from torch's default generators. A stage's training
forward therefore runs with the default CPU generator (and its CUDA device's) seeded from
:func:`stream_seed`, and the caller's generator states are restored afterwards. The default generators are
process-wide, so seeded forwards hold one process-wide lock; a stage whose first training forward draws
nothing is marked ``draws_random = False`` and never seeds or locks again (a random op that starts drawing
later, say a dropout probability scheduled up from 0, is then not seeded).

Under ``threads`` the caller keeps running while stages train: code on another thread that draws from the
default generator during a seeded forward (random augmentation in the loop that feeds the trainer) takes
numbers from that stage's stream and changes its masks; give such code its own ``torch.Generator`` or run
it in DataLoader worker processes. Backward draws nothing (masks are saved) and runs outside the lock, except
the recompute of a checkpointed segment (``checkpoint_activations=True``), which replays its forward's generator
states under the same lock (:data:`RNG_LOCK` is :data:`ppll_compile.lower.stages.RNG_LOCK`).

With ``compile_stages`` the stages' forwards run under ``torch.compile``; its inductor backend then draws through
these same default generators, in eager's order (``fallback_random``, see :mod:`.compiled`), so a compiled stage
draws the masks an eager one draws and the equalities above hold compiled too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from ..lower.stages import RNG_LOCK  # one lock: seeded forwards and the recomputes of checkpointed segments

_MASK = (1 << 64) - 1


def stream_seed(seed: int, stage: int, batch: int, *, reused: bool = False, replica: int = 0) -> int:
    """The 64-bit seed of a stage's training randomness on one batch: a splitmix64 chain over the arguments.

    Stable across processes, platforms and Python versions (no salted ``hash``); every argument changes it.
    ``batch`` is the batch's sequence number (:attr:`Message.index`), ``reused`` whether the stage trains
    on that input a second time (``queue="latest"``), ``replica`` the stage replica (distributed runtime).
    """
    h = 0
    for value in (seed, stage, batch, int(reused), replica):
        h = ((h ^ (value & _MASK)) + 0x9E3779B97F4A7C15) & _MASK
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK
        h ^= h >> 31
    return h


class StageRNG:
    """Runs a stage's training forwards with torch's default generators seeded, under :data:`RNG_LOCK`.

    The first seeded forward compares the generator states before and after; when nothing was drawn,
    :attr:`draws_random` becomes ``False`` and the caller skips seeding (and the lock) from then on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.draws_random: bool | None = None
        """Whether the stage's training forward draws random numbers; ``None`` until its first one ran."""
        self._gens: list[torch.Generator] = []

    def _generators(self) -> list[torch.Generator]:
        if not self._gens:
            gens = [torch.default_generator]
            if self.device.type == "cuda":
                torch.cuda.init()  # the CUDA default generators exist once CUDA is initialised
                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                gens.append(torch.cuda.default_generators[index])
            self._gens = gens
        return self._gens

    @contextlib.contextmanager
    def seeded(self, seed: int) -> Iterator[None]:
        """Run the body with the default CPU generator (and the stage's CUDA one) seeded by ``seed``.

        Holds :data:`RNG_LOCK` throughout and restores the generators' earlier states on exit.
        """
        gens = self._generators()
        with RNG_LOCK:
            saved = [g.get_state() for g in gens]
            try:
                for g in gens:
                    g.manual_seed(seed)
                fresh = [g.get_state() for g in gens] if self.draws_random is None else None
                yield
                if fresh is not None:
                    self.draws_random = any(not torch.equal(g.get_state(), f) for g, f in zip(gens, fresh))
            finally:
                for g, state in zip(gens, saved):
                    g.set_state(state)
