"""Watching a run: the recompile guard, divergence, metrics (JSONL, TensorBoard, progress bar), Weights & Biases."""
