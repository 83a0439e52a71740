"""How far the host may run ahead of the device: one step.

`torch_xla.sync()` dispatches a step's graph and returns; the host then replays the next step
while the device runs this one, which keeps the device busy. Nothing else in a step waits for
the device (log steps do, once every `logging.every` steps), so without a bound the host queues
steps as fast as it replays them, up to the runtime's limit on computations in flight (torch_xla
allows 32), and a stop signal's checkpoint waits for every queued step first: at 4-5 s a step
(Mistral-7B on v6e-8) that is more than a spot VM's 30-second notice. Measured on a CPU
(`make bench-stop`), a signal 2 s into a run of 0.12 s steps found about 32 steps queued, and
the checkpoint was complete 4.15 s later (median of 3); with this bound, 0.20 s later.

After dispatching step N the host waits for step N-1 to finish: the device always has step N
queued while the host waits, so it never idles for it, and a stop decided after step N waits
for at most steps N-1 and N before the checkpoint is written.
"""

from __future__ import annotations

from collections import deque

import torch

STEPS_AHEAD = 1


class RunAheadBound:
    """`dispatched(marker)` after each step's `torch_xla.sync()`, with a small tensor that step's
    graph computed; it returns once the device has finished all but the last `steps_ahead` steps."""

    def __init__(self, steps_ahead: int = STEPS_AHEAD, wait=None) -> None:
        self.steps_ahead = steps_ahead
        self.wait = wait or wait_until_computed
        self.in_flight: deque[torch.Tensor] = deque()

    def dispatched(self, marker: torch.Tensor) -> None:
        self.in_flight.append(marker)
        while len(self.in_flight) > self.steps_ahead:
            self.wait(self.in_flight.popleft())


def wait_until_computed(tensor: torch.Tensor) -> None:
    """Block until the graph that computes `tensor` has run, and only that long: reading a
    materialised XLA tensor waits for the dispatch of what came before it on its device (torch_xla's
    DeviceBarrier ends at dispatch, not at completion) and then for its own buffer, not for the
    later graphs that read it. A few bytes cross to the host; no graph is compiled or run."""
    tensor.cpu()
