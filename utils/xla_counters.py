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
    # Inputs donated to outputs by the graphs compiled (InputOutputAliasCount, summed): with
    # XLA_ENABLE_PARAM_ALIASING on, an in-place update reuses its input's buffer instead of
    # holding a second copy of the state it updates.
    donated_buffers: int = 0

    def __sub__(self, other: "XlaCounters") -> "XlaCounters":
        return XlaCounters(
            self.compiles - other.compiles,
            self.compile_seconds - other.compile_seconds,
            self.host_syncs - other.host_syncs,
            self.transfers_from_device - other.transfers_from_device,
            self.donated_buffers - other.donated_buffers,
        )


def read_counters() -> XlaCounters:
    import torch_xla.debug.metrics as met

    compile_data = met.metric_data("CompileTime")
    transfer_data = met.metric_data("TransferFromDeviceTime")
    alias_data = met.metric_data("InputOutputAliasCount")
    return XlaCounters(
        compiles=int(compile_data[0]) if compile_data else 0,
        compile_seconds=float(compile_data[1]) / 1e9 if compile_data else 0.0,
        host_syncs=int(met.counter_value("aten::_local_scalar_dense") or 0),
        transfers_from_device=int(transfer_data[0]) if transfer_data else 0,
        donated_buffers=int(alias_data[1]) if alias_data else 0,
    )
