"""Heads: a policy file and a boundary tensor in, the auxiliary head of a block and its measured cost out.

Takes: a policy (:mod:`.policy`, options checked by :mod:`.schema`) and the tensors crossing a cut.
Gives: the head a config describes and its cost (:mod:`.build`), from the table of head types (:mod:`.types`,
:mod:`.registry`, which user code extends with ``register_head_type``); the head modules (:mod:`.modules`,
:mod:`.output`) and the task's losses (:mod:`.losses`)."""

from .losses import IGNORE_INDEX, logits_of, model_loss, task_loss, task_of
from .modules import AuxHead, InfoProHead, MomentumHead, head_loss

__all__ = ["AuxHead", "InfoProHead", "MomentumHead", "model_loss", "head_loss", "task_loss", "task_of", "logits_of",
           "IGNORE_INDEX"]
