"""Code that trains to check or measure, apart from the pure planning (planning/): preflight's
rehearsal on a shrunken model (rehearsal.py) and `make tpu-check`'s runs of a runtime's TPU-only
paths: the XLA runtime's (device_check.py) and the native runtime's (native_check.py), each named
by its runtime's Backend.self_check and found here by that name (self_check_of)."""

from __future__ import annotations


def self_check_of(runtime):
    """The check of `runtime`'s (a runtime/protocol.py Backend) TPU paths: device_check or
    native_check, which share one signature."""
    from finetuning_pipeline.checks import device_check, native_check

    checks = {"device_check": device_check.device_check, "native_check": native_check.native_check}
    return checks[runtime.self_check]
