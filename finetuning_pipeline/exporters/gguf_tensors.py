"""Tensors in GGUF's types, one at a time: a base read from its safetensors files (mapped, not
copied), encoded in the output type.

Output types (`--outtype`), as llama.cpp's converter writes them: f32 writes everything in fp32;
f16, bf16, q8_0 and q4_0 write the 2-D weights in that type and the 1-D tensors (norms, biases)
in fp32. A weight whose rows are not a multiple of 32 values cannot be cut into q8_0's or q4_0's
blocks and is written in f16 (said on the way). Q8_0 and Q4_0 bytes come from
lora_logic/quantize.py, which is ggml's arithmetic bit for bit (the bytes gguf-py's quantizer
writes), the same quantizer that stores a quantized base in training. K-quants (Q4_K_M, ...) need
llama.cpp's `llama-quantize` on an f16 or bf16 export.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open

from lora_logic.quantize import BLOCK, quantize

Q = gguf.GGMLQuantizationType
OUTTYPES = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
QUANTIZED = {Q.Q8_0: "q8_0", Q.Q4_0: "q4_0"}
ROWS_VALUES = 1 << 24  # values encoded at a time: 64 MiB of fp32


def tensor_type(outtype: str, shape: tuple[int, ...]) -> Q:
    """The GGUF type a tensor of `shape` is written in for `outtype`."""
    if len(shape) < 2 or outtype == "f32":
        return Q.F32
    wanted = OUTTYPES[outtype]
    if wanted in QUANTIZED and shape[-1] % BLOCK[QUANTIZED[wanted]]:
        return Q.F16
    return wanted


def encoded_bytes(shape: tuple[int, ...], qtype: Q) -> int:
    """How many bytes a tensor of `shape` takes in `qtype`."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def encode(tensor: torch.Tensor, qtype: Q) -> np.ndarray:
    """`tensor` (fp32) as the array gguf-py writes for `qtype`: fp32 or fp16 values, bf16 as its
    16-bit patterns, a quantized type as its rows of blocks (each block: its fp16 scale, then its
    codes, as ggml lays them out)."""
    if qtype == Q.F32:
        return tensor.contiguous().numpy()
    if qtype == Q.F16:
        return tensor.to(torch.float16).contiguous().numpy()
    if qtype == Q.BF16:
        return tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    rows = tensor.reshape(-1, tensor.shape[-1])
    q = quantize(rows, QUANTIZED[qtype])
    blocks = rows.shape[1] // BLOCK[q.format]
    scales = q.scales.contiguous().view(torch.uint8).numpy().reshape(rows.shape[0], blocks, 2)
    codes = q.codes.contiguous().view(torch.uint8).numpy().reshape(rows.shape[0], blocks, -1)
    return np.concatenate([scales, codes], axis=2).reshape(*tensor.shape[:-1], -1)


def encode_in_row_blocks(read_rows, shape: tuple[int, ...], qtype: Q) -> np.ndarray:
    """`encode` of a tensor read `ROWS_VALUES` at a time (`read_rows(start, stop)` gives rows as
    fp32, already in llama.cpp's values): the host holds the encoded tensor and one block of rows,
    never the whole tensor in fp32 (an embedding of 128k x 4096 is 2 GiB in fp32)."""
    rows = shape[0]
    step = max(1, ROWS_VALUES // max(1, int(np.prod(shape[1:], dtype=np.int64))))
    encoded = None
    for start in range(0, rows, step):
        block = encode(read_rows(start, min(rows, start + step)), qtype)
        if encoded is None:
            encoded = np.empty((rows, *block.shape[1:]), dtype=block.dtype)
        encoded[start:start + block.shape[0]] = block
    return encoded


def add_tensor_info(writer: gguf.GGUFWriter, name: str, shape: tuple[int, ...], qtype: Q) -> None:
    """Declare a tensor before any data is written (the file's header lists them all)."""
    if qtype in QUANTIZED:
        byte_shape = (*shape[:-1], encoded_bytes((shape[-1],), qtype))
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), encoded_bytes(shape, qtype), raw_dtype=qtype)
    elif qtype == Q.BF16:
        writer.add_tensor_info(name, shape, np.dtype(np.uint16), encoded_bytes(shape, qtype), raw_dtype=qtype)
    else:
        dtype = np.dtype(np.float32 if qtype == Q.F32 else np.float16)
        writer.add_tensor_info(name, shape, dtype, encoded_bytes(shape, qtype))


def safetensors_files(base: Path) -> list[Path]:
    """The base's weight files, or a ValueError saying why there are none to read."""
    index = base / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [base / name for name in dict.fromkeys(weight_map.values())]
    single = base / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(f"--base {base}: no model.safetensors (or its index); the GGUF export reads safetensors "
                     "weights (save the model with save_pretrained)")


SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16"}


class BaseTensors:
    """The base's tensors by name, read lazily from its mapped safetensors files."""

    def __init__(self, base: Path):
        self._stack = ExitStack()
        self._where: dict[str, object] = {}
        for path in safetensors_files(base):
            handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
            for name in handle.keys():
                self._where[name] = handle

    def names(self) -> list[str]:
        return list(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name].get_slice(name).get_shape())

    def float_dtypes(self) -> set[str]:
        """torch's names of the float dtypes the base's tensors are stored in ({"bfloat16"}, ...)."""
        stored = {handle.get_slice(name).get_dtype() for name, handle in self._where.items()}
        return {SAFETENSORS_FLOATS[d] for d in stored if d in SAFETENSORS_FLOATS}

    def fp32(self, name: str) -> torch.Tensor:
        return self._where[name].get_tensor(name).float()

    def fp32_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows start:stop of a tensor, read alone from the file."""
        return self._where[name].get_slice(name)[start:stop].float()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> "BaseTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
