"""Analysis: a captured, costed graph in, the model as the placement reads it out.

Takes: a graph from :mod:`..capture` and its node costs from :mod:`..cost`.
Gives: :class:`~.analyse.Analysis` (:mod:`.analyse`): the legal cut points (:mod:`.cuts`: nodes whose output
carries everything later nodes need; :mod:`.batch_cuts`: those that keep the batch first), tensor layouts
(:mod:`.layout`) and the segments between cuts with their costs; for a ``ppll`` plan, the cuts it can use
(:mod:`.usable`), whether each stage's loss reaches every parameter the stage holds (:mod:`.reach`), and the
auxiliary head at each cut with its cost (:mod:`.cut_heads`)."""
