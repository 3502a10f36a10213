"""Benchmarks of ppll-compile, kept apart from the tests; each writes its results to ``results/``."""
