"""Pipe-BD: blockwise distillation of a student from a frozen teacher, planned as a pipeline of aligned blocks."""

