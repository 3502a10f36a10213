"""Pipe-BD: blockwise distillation of a student from a frozen teacher, planned as a pipeline of aligned blocks.

Takes: a teacher, a student and a loss policy (:mod:`.policy`). Gives: their blocks aligned by boundary shape
(:mod:`.align`), costed, placed and assembled into a ``pipebd`` plan and lowered to block modules (:mod:`.build`),
with the phases below (:mod:`..analysis`, :mod:`..place`, :mod:`..lower`).
"""

