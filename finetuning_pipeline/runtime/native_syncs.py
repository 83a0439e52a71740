"""Host syncs of a native step, counted by PyTorch's profiler.

A host sync is an op whose result the host must read before it can go on, so it waits there for
the device to finish everything queued before it: `.item()`, `bool(tensor)`, `int(tensor)` (ATen's
`_local_scalar_dense`, what torch_xla's own counter counts on the XLA runtime) and `nonzero`,
whose output's shape is its input's values (boolean-mask indexing, `torch.where(mask)`). On a CPU
nothing waits, but the same ops run, so a CPU run counts what would stall a GPU or a TPU.

PyTorch keeps no counter of them, and a dispatch mode that counted every op would make dynamo
run the compiled layers eagerly (or, under torch 2.9, compile them again), so the native runtime
counts one step: the profiler records its ops' names, which changes nothing of what runs.
"""

from __future__ import annotations

import os

SYNCING_OPS = ("aten::_local_scalar_dense", "aten::nonzero")


class HostSyncCount:
    """`with HostSyncCount() as count:` ... then `count.value`: the host syncs of what ran
    inside, or None where the profiler recorded no op at all (it did not run: nothing counted
    is not 0 syncs)."""

    def __init__(self) -> None:
        self.value: int | None = None
        self._profiler = None

    def __enter__(self) -> "HostSyncCount":
        # kineto's own log lines (a CPU-only CUDA build's "gpuGetDeviceCount failed", torch 2.13's
        # profiler_start/stop) would land in the run's console; the user's setting is kept.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        from torch.profiler import ProfilerActivity, profile

        self._profiler = profile(activities=[ProfilerActivity.CPU])
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        names = [event.name for event in self._profiler.events()]
        self.value = sum(name in SYNCING_OPS for name in names) if names else None
