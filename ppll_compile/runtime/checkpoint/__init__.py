"""What leaves a training run: checkpoints and the trained model.

Takes: a trainer's stages. Gives: checkpoint directories (:mod:`.store`, written by :mod:`.files`, agreed on across
processes by :mod:`.checkpointer`, each stage's state checked by :mod:`.state_check`) and the whole trained model
gathered from its stages (:mod:`.model_state`, :mod:`.gather`, :mod:`.model_files`)."""

from .store import latest

__all__ = ["latest"]
