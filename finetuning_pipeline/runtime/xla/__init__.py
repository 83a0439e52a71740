"""The XLA runtime: torch_xla over PJRT, the TPU's path and the default (runtime/__init__.py).
Everything that imports torch_xla lives in this package."""
