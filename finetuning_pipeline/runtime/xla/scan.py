"""torch_xla's `scan` (an XLA While loop over a traced body), one thread at a time.

torch_xla 2.9's scan traces its body with torch.fx (make_fx and AOTAutograd's partitioner),
whose patcher is process-global: two threads tracing at once fail with `assert
CURRENT_PATCHER is not None` (measured: the two replica threads of a TPU v2/v3 process, here
rehearsed with CPU_NUM_DEVICES=2, crashed at their first evaluation through the chunked
loss). The lock is held while the body is traced and lowered into the lazy graph, which is
host work only; what runs on the device is untouched. Reentrant: a scanned body may scan.
"""

from __future__ import annotations

import threading

FX_TRACING = threading.RLock()


def scan(fn, init, xs, **kwargs):
    """`torch_xla.experimental.scan.scan(fn, init, xs, **kwargs)`, serialised across threads."""
    from torch_xla.experimental.scan import scan as xla_scan

    with FX_TRACING:
        return xla_scan(fn, init, xs, **kwargs)
