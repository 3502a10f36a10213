"""The examples, importable from the repository root (``from examples.resnet32 import build_model``, as the README's
code blocks do when run in ``python`` there) and runnable as scripts (``python examples/train_digits.py``)."""
