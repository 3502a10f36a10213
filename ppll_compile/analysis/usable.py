"""The cuts a ``ppll`` plan can use: a stage on either side trains something, no parameter is trained on both sides
(under ``tied='error'``), a head of the policy reads the tensor, the blocks that head copies or follows begin
there, and the loss of the stage before it reaches every parameter that stage uses (:mod:`.reach`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import PolicyError
from ..heads.output import NoOutputProjection
from ..heads.policy import Policy
from .analyse import Analysis
from .cut_heads import FindBlocks, copied_after
from .cuts import Cut
from .reach import Reach, listed, unaccepted


def drop_unusable_cuts(a: Analysis, policy: Policy, tied: str, model: str) -> Analysis:
    """``a`` without the cuts a ``ppll`` plan cannot use: a stage on one side would train nothing, a parameter
    would be trained on both sides (``tied='error'``), or no head of ``policy`` reads the tensor."""
    if a.per_token and policy.builder is None and policy.per_token is None:
        raise PolicyError(f"policy {policy.name!r} has no per-token head, but {model} gives per-token scores "
                          f"(N x L x C), so its labels are per token (N x L); use policy='lm', or add a "
                          f"'per_token:' entry (type lm) to {policy.source or 'the policy file'}")
    a = a.drop_untrained_cuts()
    if tied == "error":
        a = a.drop_shared_cuts()

    def unread(cut: Cut) -> str | None:
        spec = a.boundary(cut)[0]
        readable = "float" in spec.dtype  # not a mask, not token ids
        if readable and policy.fits(spec, a.per_token):
            return None
        return f"{len(spec.shape)}-D{'' if readable else ' ' + spec.dtype} {tuple(spec.shape)}" + \
            (f" {spec.layout}" if spec.layout else "")

    return a.keep_cuts(unread, f"no head of policy {policy.name!r} reads their tensors")


def drop_blockless_cuts(a: Analysis, policy: Policy, find: FindBlocks) -> Analysis:
    """``a`` without the cuts after which no block begins, where the policy's head copies or follows the next
    blocks (a ``transformer`` head with ``init: copy``, a ``momentum`` head)."""
    def blockless(cut: Cut) -> str | None:
        try:
            copied_after(a, policy, cut, None, find)
        except NoOutputProjection:  # the model's, not the cut's: no cut would do
            raise
        except PolicyError as e:
            return str(e)
        return None

    return a.keep_cuts(blockless,
                       f"policy {policy.name!r} copies or follows the blocks after a cut, and too few begin there")


def drop_stranding_cuts(a: Analysis, reach: Reach, frozen: Sequence[str]) -> Analysis:
    """``a`` without the cuts that would leave a trainable parameter of the stage before them untrained, whichever
    stage they close (:meth:`.reach.Reach.stranding`): its value crosses the cut beside the main tensor, which is all
    the stage's head reads. Parameters ``frozen`` names are accepted as untrained."""
    def strands(cut: Cut) -> str | None:
        names = unaccepted(reach.stranding(cut.node), frozen)
        return (f"parameter(s) {listed(names, 2)} would never train: their values cross the cut beside the tensor its "
                f"head reads; frozen=[...] accepts that") if names else None

    return a.keep_cuts(strands, "the stage before them would not train every parameter it holds")
