"""NVIDIA data-centre GPUs the native runtime's plan knows: what a `gpu.type` such as h100-80gb gives.

Card facts, from NVIDIA's product pages (read 2026-11), dense bf16 tensor FLOP/s (the pages'
"with sparsity" figures halved) and memory:
  h200       https://www.nvidia.com/en-us/data-center/h200/   989 TFLOP/s (SXM), 141 GB HBM3e
  h100-80gb  https://www.nvidia.com/en-us/data-center/h100/   989 TFLOP/s (SXM), 80 GB HBM3
  a100-80gb  https://www.nvidia.com/en-us/data-center/a100/   312 TFLOP/s, 80 GB HBM2e
  a100-40gb  https://www.nvidia.com/en-us/data-center/a100/   312 TFLOP/s, 40 GB HBM2
  l40s       https://www.nvidia.com/en-us/data-center/l40s/   362 TFLOP/s, 48 GB GDDR6
  l4         https://www.nvidia.com/en-us/data-center/l4/     121 TFLOP/s, 24 GB GDDR6
Where a page says GB we count decimal gigabytes (80 GB = 74.5 GiB), as tpu_chips.py does: the
conservative reading (PyTorch reports 79.1 GiB on an H100 80GB, some of it the CUDA context's).

A card is planned as tpu_plan.py plans a TPU generation whose chips are one device each, so the
plan's arithmetic (FLOPs at an assumed MFU, device-hours) is the same code for both.
"""

from __future__ import annotations

from finetuning_pipeline.planning.tpu_chips import GB, Generation, Slice

MAX_GPUS_PER_HOST = 8  # an HGX board; more GPUs are a torchrun run over several hosts


def _card(name: str, tflops: float, gb: int, source: str) -> Generation:
    return Generation(name, tflops, gb * GB, devices_per_chip=1, type_counts_cores=False,
                      chips_per_host=MAX_GPUS_PER_HOST, max_single_host_chips=MAX_GPUS_PER_HOST, source=source)


CARDS = {
    card.name: card
    for card in (
        _card("h200", 989, 141, "https://www.nvidia.com/en-us/data-center/h200/"),
        _card("h100-80gb", 989, 80, "https://www.nvidia.com/en-us/data-center/h100/"),
        _card("a100-80gb", 312, 80, "https://www.nvidia.com/en-us/data-center/a100/"),
        _card("a100-40gb", 312, 40, "https://www.nvidia.com/en-us/data-center/a100/"),
        _card("l40s", 362, 48, "https://www.nvidia.com/en-us/data-center/l40s/"),
        _card("l4", 121, 24, "https://www.nvidia.com/en-us/data-center/l4/"),
    )
}


def parse_gpu_type(gpu_type: str, count: int) -> Slice:
    """`h100-80gb` and a count of GPUs (>= 1: validate.py) -> Slice (one device per card); ValueError
    naming the key otherwise."""
    card = CARDS.get(gpu_type.strip().lower())
    if card is None:
        raise ValueError(f"gpu.type {gpu_type!r}: expected one of {sorted(CARDS)}; for another card, plan with the "
                         "nearest one in memory and FLOP/s")
    return Slice(f"{card.name} x{count}", card, count)
