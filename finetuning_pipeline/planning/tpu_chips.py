"""Cloud TPU generations and accelerator types: what a `tpu.type` such as v5e-8 gives you.

Chip facts, from the Cloud TPU system-architecture pages (read 2026-11):
  v2   https://cloud.google.com/tpu/docs/v2    45 TFLOP/s bf16 per chip, 16 GiB HBM per chip
       (two TensorCores per chip, each its own device with 8 GiB; Colab's and Kaggle's v2-8)
  v3   https://cloud.google.com/tpu/docs/v3    123 TFLOP/s bf16 per chip, 32 GiB HBM per chip
       (two TensorCores per chip, each its own device with 16 GiB)
  v4   https://cloud.google.com/tpu/docs/v4    275 TFLOP/s bf16 per chip, 32 GiB HBM2
  v5e  https://cloud.google.com/tpu/docs/v5e   197 TFLOP/s bf16 per chip, 16 GB HBM2, 8 chips per host
  v5p  https://cloud.google.com/tpu/docs/v5p   459 TFLOP/s bf16 per chip, 95 GB HBM2e
  v6e  https://cloud.google.com/tpu/docs/v6e   918 TFLOP/s bf16 per chip, 32 GB HBM, 8 chips per host
Where a page says GB we count decimal gigabytes (16 GB = 14.9 GiB): the conservative reading.

Naming: for v2, v3, v4 and v5p the number in the type counts TensorCores (v4-8 is 4 chips);
for v5e (v5litepod) and v6e it counts chips (v5e-8 is 8 chips). v4 and v5p chips present
their two TensorCores as one device (megacore); v2's and v3's are two devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024**3
GB = 1000**3


@dataclass(frozen=True)
class Generation:
    name: str
    bf16_tflops_per_chip: float
    hbm_bytes_per_chip: int
    devices_per_chip: int  # PJRT devices (what one process in dp, or one mesh entry, drives)
    type_counts_cores: bool  # the number in the accelerator type counts TensorCores, not chips
    chips_per_host: int  # of a multi-host slice; single-host types may hold more (v5e-8, v6e-8)
    max_single_host_chips: int
    source: str


GENERATIONS = {
    g.name: g
    for g in (
        Generation("v2", 45, 16 * GIB, 2, True, 4, 4, "https://cloud.google.com/tpu/docs/v2"),
        Generation("v3", 123, 32 * GIB, 2, True, 4, 4, "https://cloud.google.com/tpu/docs/v3"),
        Generation("v4", 275, 32 * GIB, 1, True, 4, 4, "https://cloud.google.com/tpu/docs/v4"),
        Generation("v5e", 197, 16 * GB, 1, False, 4, 8, "https://cloud.google.com/tpu/docs/v5e"),
        Generation("v5p", 459, 95 * GB, 1, True, 4, 4, "https://cloud.google.com/tpu/docs/v5p"),
        Generation("v6e", 918, 32 * GB, 1, False, 4, 8, "https://cloud.google.com/tpu/docs/v6e"),
    )
}
ALIASES = {"v5litepod": "v5e"}


@dataclass(frozen=True)
class Slice:
    """One accelerator type: its generation and how many chips, devices and hosts it has."""

    type: str
    generation: Generation
    chips: int

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def hosts(self) -> int:
        g = self.generation
        return 1 if self.chips <= g.max_single_host_chips else self.chips // g.chips_per_host

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.generation.hbm_bytes_per_chip // self.generation.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        return self.generation.bf16_tflops_per_chip * 1e12 / self.generation.devices_per_chip


def parse_tpu_type(tpu_type: str) -> Slice:
    """`v5e-8`, `v5litepod-16`, `v6e-8`, `v4-32`, `v5p-8`, `v3-8` -> Slice; ValueError otherwise."""
    match = re.fullmatch(r"(v\d+[a-z]*|v5litepod)-(\d+)", tpu_type.strip())
    name = ALIASES.get(match.group(1), match.group(1)) if match else None
    if name not in GENERATIONS:
        raise ValueError(f"tpu.type {tpu_type!r}: expected <generation>-<size> with generation one of "
                         f"{sorted(GENERATIONS)} (e.g. v5e-8, v6e-8, v4-32)")
    generation = GENERATIONS[name]
    size = int(match.group(2))
    if generation.type_counts_cores and size % 2:
        raise ValueError(f"tpu.type {tpu_type!r}: {name} sizes count TensorCores, two per chip; use an even size")
    chips = size // 2 if generation.type_counts_cores else size
    if chips < 1:
        raise ValueError(f"tpu.type {tpu_type!r}: no chips")
    return Slice(tpu_type, generation, chips)
