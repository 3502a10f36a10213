"""The examples follow their own advice: the ppll-plan command a docstring gives plans what the example trains, no
example leaves the CPU fallback to a warning, and every torch.load in them loads tensors only."""
