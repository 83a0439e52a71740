"""Block quantization of a frozen weight: ggml's q8_0 and q4_0, QLoRA's nf4.

Each format's values are defined outside this project, so a base quantized here is the same
base elsewhere:
- q8_0 and q4_0: ggml's (llama.cpp's GGUF types), bit for bit as gguf-py 0.19.0's
  `gguf.quants.quantize` writes them: blocks of 32, one fp16 scale a block. A run trained on a
  q8_0 or q4_0 base can ship that very base as GGUF, and llama.cpp serves the values the
  adapter was trained against.
- nf4: QLoRA's (Dettmers et al. 2023) as bitsandbytes writes it: blocks of 64, the block's
  absolute maximum as an fp32 scale, each value the nearest of the 16 NF4 code values
  (bitsandbytes' own thresholds, the midpoints between them); no double quantization.

A weight [out, in] is cut into blocks of consecutive values along its input dimension, which
must be a multiple of the block (32, or 64 for nf4). Blocks never cross a row, as GGUF stores
them; for nf4 these are bitsandbytes' blocks too (it blocks the flattened weight). The codes
and scales keep the weight's rows ([out, in / values per byte] and [out, in / block]), so a
row's codes and scales shard together.

The arithmetic follows the reference step by step in fp32 (`torch.round` rounds half to even,
ggml away from zero; q4_0 truncates x/d + 8.5): the tests compare the bytes with gguf-py's.
A dequantized value is exactly one product, code value x scale, in fp32, cast once to the
compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from utils.device_ops import ops_for

FORMATS = ("q8_0", "q4_0", "nf4")
BLOCK = {"q8_0": 32, "q4_0": 32, "nf4": 64}
VALUES_PER_BYTE = {"q8_0": 1, "q4_0": 2, "nf4": 2}
CHUNK_VALUES = 1 << 20  # values quantized at a time: bounds the host's temporaries (about 4 MB each)

# The NF4 code values (QLoRA, appendix E) and bitsandbytes' decision thresholds between them
# (`dQuantizeNF4`, csrc/kernels.cu), as the fp32 constants bitsandbytes compiles.
NF4_CODE = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)
NF4_THRESHOLDS = (
    -0.8480964004993439, -0.6106329262256622, -0.4599952697753906, -0.33967943489551544,
    -0.23460740596055984, -0.13791173323988914, -0.045525018125772476, 0.03979014977812767,
    0.1202552504837513, 0.2035212516784668, 0.2920137718319893, 0.3893125355243683,
    0.5016634166240692, 0.6427869200706482, 0.8614784181118011,
)


@dataclass
class QuantizedWeight:
    """A weight of `shape` [out, in] in `format`: `codes` [out, in / values per byte] (q8_0: int8,
    one a value; q4_0 and nf4: uint8, two a byte) and `scales` [out, in / block] (fp16 for ggml's
    formats, fp32 for nf4)."""

    format: str
    shape: tuple[int, ...]
    codes: torch.Tensor
    scales: torch.Tensor


def quantization_problem(fmt: str, shape: tuple[int, ...]) -> str | None:
    """Why a weight of `shape` cannot be stored in `fmt` (None: it can)."""
    if fmt not in FORMATS:
        return f"unknown format {fmt!r}; one of none, {', '.join(FORMATS)}"
    if len(shape) != 2:
        return f"a weight of {len(shape)} dimensions; a Linear's is [out, in]"
    if shape[1] % BLOCK[fmt]:
        return f"its input dimension {shape[1]} is not a multiple of {fmt}'s block of {BLOCK[fmt]}"
    return None


def quantize(weight: torch.Tensor, fmt: str, values_in: torch.dtype | None = None) -> QuantizedWeight:
    """`weight` (any float dtype, on the host) in `fmt`; its values are read as fp32, after a cast
    to `values_in` when given (the weight as a model in that dtype would hold it), a chunk at a time."""
    problem = quantization_problem(fmt, tuple(weight.shape))
    if problem:
        raise ValueError(f"cannot quantize a weight of shape {list(weight.shape)} to {fmt}: {problem}")
    out, width = weight.shape
    rows = max(1, CHUNK_VALUES // width)
    codes, scales = [], []
    for start in range(0, out, rows):  # a few MB of fp32 temporaries at a time, whatever the weight's size
        chunk = weight[start:start + rows].detach().to(device="cpu", dtype=values_in or weight.dtype)
        blocks = chunk.to(torch.float32).reshape(-1, BLOCK[fmt])
        if not bool(torch.isfinite(blocks).all()):
            raise ValueError(f"cannot quantize a weight of shape {list(weight.shape)}: it holds NaN or inf")
        chunk_codes, chunk_scales = {"q8_0": _q8_0, "q4_0": _q4_0, "nf4": _nf4}[fmt](blocks)
        codes.append(chunk_codes.reshape(-1, width // VALUES_PER_BYTE[fmt]))
        scales.append(chunk_scales.reshape(-1, width // BLOCK[fmt]))
    return QuantizedWeight(fmt, (out, width), torch.cat(codes), torch.cat(scales))


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    """1/d, and 0 for an all-zero block (ggml's `d ? 1/d : 0`)."""
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf as gguf-py writes it (np_roundf), operation for operation."""
    a = x.abs()
    floored = a.floor()
    return x.sign() * (floored + (2 * (a - floored)).floor())


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = blocks.abs().amax(dim=1, keepdim=True) / 127
    codes = _round_half_away(blocks * _reciprocal(d)).to(torch.int8)
    return codes, d.to(torch.float16)  # the codes use the fp32 scale; the fp16 cast comes last


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # The value of largest magnitude keeps its sign: d = max / -8 maps it to code 0 exactly.
    extreme = blocks.gather(1, blocks.abs().argmax(dim=1, keepdim=True))  # the first on a tie
    d = extreme / -8
    codes = (blocks * _reciprocal(d) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
    # ggml's layout: byte j of a block holds value j (low nibble) and value j + 16 (high).
    return codes[:, :16] | (codes[:, 16:] << 4), d.to(torch.float16)


def _nf4(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    absmax = blocks.abs().amax(dim=1, keepdim=True)
    normalized = blocks * _reciprocal(absmax)  # bitsandbytes multiplies by the reciprocal too
    thresholds = torch.tensor(NF4_THRESHOLDS, dtype=torch.float32)
    codes = torch.bucketize(normalized, thresholds).to(torch.uint8)  # how many thresholds lie below
    # bitsandbytes' layout: value 2j in the high nibble of byte j, value 2j + 1 in the low.
    return (codes[:, 0::2] << 4) | codes[:, 1::2], absmax


def code_values(fmt: str, codes: torch.Tensor, nf4_code: torch.Tensor | None = None) -> torch.Tensor:
    """Each value's code as an fp32 number, [blocks, block]: the factor its scale multiplies.
    nf4_code: NF4_CODE as a tensor on the codes' device (a constant made while tracing would be
    sent to the device at every step)."""
    block = BLOCK[fmt]
    if fmt == "q8_0":
        return codes.reshape(-1, block).float()
    packed = codes.reshape(-1, block // 2)
    if fmt == "q4_0":
        return torch.cat([packed & 15, packed >> 4], dim=1).float() - 8
    nibbles = torch.stack([packed >> 4, packed & 15], dim=2).reshape(-1, block)
    return ops_for(codes).nibble_lookup(nf4_code, nibbles)  # (a tree of selects on XLA: nf4_selected)


def nf4_selected(nibbles: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[nibbles] without a gather (the XLA runtime's nibble_lookup): a tree of selects on the nibble's four bits,
    the low bit first (16 entries -> 8 -> 4 -> 2 -> 1). A lookup is an XLA gather of one table entry
    per weight value, forward and backward, and a TPU's gathers are slow; selects are elementwise
    and fuse into the matmul's operand. Each select picks a table entry, so the values are the
    lookup's, bit for bit. The entries are static slices of the table (no gather either)."""
    level = [table[i] for i in range(16)]
    for bit in range(4):
        high = ((nibbles >> bit) & 1).bool()
        level = [torch.where(high, level[2 * k + 1], level[2 * k]) for k in range(len(level) // 2)]
    return level[0]


def dequantize(q: QuantizedWeight, dtype: torch.dtype = torch.float32,
               nf4_code: torch.Tensor | None = None) -> torch.Tensor:
    """The weight `q` stands for, in `dtype`: code value x scale in fp32, cast once."""
    if q.format == "nf4" and nf4_code is None:
        nf4_code = nf4_code_tensor(q.codes.device)
    values = code_values(q.format, q.codes, nf4_code)
    return (values * q.scales.float().reshape(-1, 1)).reshape(q.shape).to(dtype)


def nf4_code_tensor(device=None) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


def stored_bytes(q: QuantizedWeight) -> int:
    """The bytes a quantized weight holds: its codes and its scales."""
    return q.codes.numel() * q.codes.element_size() + q.scales.numel() * q.scales.element_size()
