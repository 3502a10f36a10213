"""The ``ppll-plan`` command: a model file in, a printed, saved or drawn plan out.

Takes: a user's ``MODEL.py`` (:mod:`.model_file`) and flags (:mod:`.arguments`, their values :mod:`.values`).
Gives: the command (:mod:`.command`), its advice worded for flags rather than keyword arguments (:mod:`.advice`)."""
