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

        # acc_events: one cycle either way; without it torch 2.11 warns that a cycle clears its events.
        self._profiler = profile(activities=[ProfilerActivity.CPU], acc_events=True)
        self._profiler.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profiler.__exit__(*exc)
        names = [event.name for event in self._profiler.events()]
        self.value = sum(name in SYNCING_OPS for name in names) if names else None


def start_profiler_on_this_thread() -> None:
    """Start and stop the profiler once, here on the main thread, before the native replica's
    thread counts its host syncs. kineto (the profiler's library) registers its client on the
    thread that loads torch, and when the profiler first starts on another thread it prints
    "ERROR: External init callback must run in same thread as registerClient" with fprintf, which
    no log level silences (seen under torch 2.9 and 2.13 on a CPU, 2.11 on an H100). Started here
    first, it initialises its client here, once per process. The threads it starts block the stop
    signals, as the replica's do (run/stop_signal.py): they live on, and a signal they took would
    interrupt their system calls instead of reaching the main thread's handlers."""
    from finetuning_pipeline.run.stop_signal import threads_started_here_leave_signals_to_this_one

    with threads_started_here_leave_signals_to_this_one(), HostSyncCount():
        pass
