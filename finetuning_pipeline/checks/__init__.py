"""Code that trains to check or measure, apart from the pure planning (planning/): preflight's
rehearsal on a shrunken model (rehearsal.py) and `make tpu-check`'s runs of the TPU-only paths
(device_check.py)."""
