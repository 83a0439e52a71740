"""The native runtime: plain PyTorch on a CPU, a GPU or TorchTPU's `tpu` device (runtime/__init__.py).
Nothing in this package imports torch_xla."""
