"""Read torch_xla's own counters: graphs compiled, host syncs, device-to-host transfers.

These are the faults that waste TPU time (a recompile costs minutes, a sync stalls the chip)
and they show identically on XLA:CPU, so tests and benchmarks assert on them here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class XlaCounters:
    compiles: int  # graphs compiled (CompileTime samples)
    compile_seconds: float
    host_syncs: int  # aten::_local_scalar_dense: .item(), bool(tensor), print(tensor) ...
    transfers_from_device: int  # TransferFromDeviceTime samples (includes step-closure reads)

    def __sub__(self, other: "XlaCounters") -> "XlaCounters":
        return XlaCounters(
            self.compiles - other.compiles,
            self.compile_seconds - other.compile_seconds,
            self.host_syncs - other.host_syncs,
            self.transfers_from_device - other.transfers_from_device,
        )


def read_counters() -> XlaCounters:
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    transfer_data = met.metric_data("TransferFromDeviceTime")
    return XlaCounters(
        compiles=int(compile_data[0]) if compile_data else 0,
        compile_seconds=float(compile_data[1]) / 1e9 if compile_data else 0.0,
        host_syncs=int(met.counter_value("aten::_local_scalar_dense") or 0),
        transfers_from_device=int(transfer_data[0]) if transfer_data else 0,
    )


def donations_of_last_graphs(count: int) -> list[int]:
    """How many inputs each of the last `count` graphs compiled donated to its outputs (torch_xla's
    InputOutputAliasCount, one sample a compile). With XLA_ENABLE_PARAM_ALIASING on, an in-place
    update reuses its input's buffer instead of holding a second copy of the state it updates.
    The counters are the process's: replica threads sharing a process add their graphs' samples."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("InputOutputAliasCount")
    samples = data[2] if data else []
    return [int(value) for _, value in samples[-count:]] if count else []
