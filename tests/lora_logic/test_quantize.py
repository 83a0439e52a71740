"""The block formats of the quantized base: q8_0 and q4_0 byte for byte as gguf-py 0.19.0 writes
them (llama.cpp's own Python package), nf4 as bitsandbytes defines it, and the shapes and values
each refuses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from lora_logic.quantize import (
    NF4_CODE,
    NF4_THRESHOLDS,
    dequantize,
    quantization_problem,
    quantize,
    stored_bytes,
)

GGML = {"q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0}


def hard_weights(seed: int) -> torch.Tensor:
    """A [48, 128] fp32 weight whose blocks hold the cases where a port of the arithmetic goes
    wrong: a zero block, exact halves (round half away from zero, not to even), a largest value
    tied in magnitude with opposite signs (q4_0 keeps the first one's sign), values near a
    rounding boundary, tiny (subnormal after scaling) and large magnitudes, a constant block."""
    generator = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 128, generator=generator) * 0.05
    w[0, :32] = 0
    w[1, :32] = torch.arange(32) / 2.0 - 8  # -8, -7.5, ..., 7.5: every half
    w[2, :32] = 0.3
    w[2, 7] = -0.3
    w[3, :32] = torch.tensor([127 / 2**k for k in range(32)])
    w[4] *= 1e-6
    w[5] *= 1e3
    w[6, :32] = 0.7
    w[7, 32:64] = (torch.arange(32) - 16) * (1.0 / 127) + 0.5 / 127  # x/d lands on .5 for q8_0
    w[8, :32] = torch.linspace(-1, 1, 32)
    return w


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ggml_formats_are_gguf_pys_bytes_and_values(fmt, seed):
    w = hard_weights(seed)
    q = quantize(w, fmt)
    reference = gguf_quantize(w.numpy(), GGML[fmt])  # [rows, blocks * bytes per block]
    blocks = reference.reshape(-1, 34 if fmt == "q8_0" else 18)
    assert np.array_equal(q.scales.numpy().reshape(-1), blocks[:, :2].copy().view(np.float16).reshape(-1))
    assert np.array_equal(q.codes.numpy().view(np.uint8).reshape(-1), blocks[:, 2:].reshape(-1))
    assert np.array_equal(dequantize(q).numpy(), gguf_dequantize(reference, GGML[fmt]))


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0"])
def test_ggml_formats_read_bf16_weights_as_gguf_py_reads_their_fp32_values(fmt):
    w = hard_weights(3).to(torch.bfloat16)
    reference = gguf_quantize(w.float().numpy(), GGML[fmt])
    assert np.array_equal(dequantize(quantize(w, fmt)).numpy(), gguf_dequantize(reference, GGML[fmt]))


def test_nf4_thresholds_are_the_midpoints_of_the_code_values():
    code = torch.tensor(NF4_CODE, dtype=torch.float64)
    midpoints = (code[1:] + code[:-1]) / 2
    torch.testing.assert_close(torch.tensor(NF4_THRESHOLDS, dtype=torch.float64), midpoints, rtol=0, atol=1e-7)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_nf4_takes_the_nearest_code_value_of_each_value_over_its_blocks_absmax(seed):
    w = hard_weights(seed)
    q = quantize(w, "nf4")
    blocks = w.reshape(-1, 64)
    absmax = blocks.abs().amax(dim=1)
    assert torch.equal(q.scales.reshape(-1), absmax)  # fp32, one a block of 64
    normalized = blocks * torch.where(absmax == 0, 0, 1 / absmax).unsqueeze(1)
    distance = (normalized.unsqueeze(2) - torch.tensor(NF4_CODE).view(1, 1, 16)).abs()
    nearest = distance.argmin(dim=2)
    values = dequantize(q)
    expected = torch.tensor(NF4_CODE)[nearest] * absmax.unsqueeze(1)
    # Exactly on a midpoint (none here but by chance) bitsandbytes takes the lower code.
    assert torch.equal(values.reshape(-1, 64), expected)


def test_nf4_packs_the_first_value_of_a_pair_in_the_high_nibble_as_bitsandbytes_does():
    w = torch.tensor(NF4_CODE * 4).reshape(1, 64)  # codes 0..15 four times, absmax 1
    q = quantize(w, "nf4")
    assert q.codes.tolist() == [[(2 * j % 16) << 4 | (2 * j + 1) % 16 for j in range(32)]]
    assert torch.equal(dequantize(q), w)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_0", "nf4"])
def test_a_dequantized_value_is_one_fp32_product_cast_once(fmt):
    w = hard_weights(4)
    q = quantize(w, fmt)
    fp32 = dequantize(q, torch.float32)
    assert torch.equal(dequantize(q, torch.bfloat16), fp32.to(torch.bfloat16))
    assert torch.equal(dequantize(quantize(torch.zeros(2, 64), fmt)), torch.zeros(2, 64))


@pytest.mark.parametrize(("fmt", "ratio"), [("q8_0", 0.55), ("q4_0", 0.30), ("nf4", 0.30)])
def test_the_stored_bytes_shrink_to_the_formats_size(fmt, ratio):
    w = torch.randn(64, 256)
    bf16_bytes = w.numel() * 2
    assert stored_bytes(quantize(w, fmt)) <= ratio * bf16_bytes


def test_shapes_a_format_cannot_hold_are_refused_with_the_reason():
    assert quantization_problem("q8_0", (16, 64)) is None
    assert "input dimension 48 is not a multiple of q4_0's block of 32" in quantization_problem("q4_0", (4, 48))
    assert "input dimension 32 is not a multiple of nf4's block of 64" in quantization_problem("nf4", (2, 32))
    assert "unknown format 'int3'" in quantization_problem("int3", (4, 32))
    with pytest.raises(ValueError, match=r"shape \[4, 48\] to q8_0: its input dimension 48"):
        quantize(torch.zeros(4, 48), "q8_0")
    bad = torch.zeros(2, 32)
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        quantize(bad, "q8_0")
