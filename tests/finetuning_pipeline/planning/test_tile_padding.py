"""The plan counts what the TPU's tiled layout pads of a quantized base: scale rows
shorter than 128 lanes (nf4's 64 on 4096-wide layers; every format's on a model 896 wide)."""

from __future__ import annotations

import pytest

from finetuning_pipeline.planning.tpu_plan import quantized_linear_bytes, tiled_bytes


def test_a_tile_is_128_lanes_by_8_16_or_32_rows_by_the_values_width():
    assert tiled_bytes(8, 128, 4) == 8 * 128 * 4  # one whole tile: nothing padded
    assert tiled_bytes(1, 1, 4) == 8 * 128 * 4
    assert tiled_bytes(16, 129, 2) == 16 * 256 * 2
    assert tiled_bytes(33, 128, 1) == 64 * 128


@pytest.mark.parametrize("fmt, per_weight", [("q8_0", 1 + 2 / 32), ("q4_0", 0.5 + 2 / 32),
                                             ("nf4", 0.5 + 2 * 4 / 64)])  # nf4: 64 scales a row, padded to 128
def test_a_4096_wide_layer_pads_only_nf4s_scales(fmt, per_weight):
    assert quantized_linear_bytes(4096, 4096, fmt) == pytest.approx(4096 * 4096 * per_weight)


def test_a_model_896_wide_pads_every_formats_scales_and_nf4s_codes():
    """Qwen2.5-0.5B's q_proj: 28 scales a row (896 / 32) take 128 lanes (4.6x), nf4's 14 fp32 ones
    too (9.1x), and nf4's 448 code bytes a row take 512."""
    weights = 896 * 896
    assert quantized_linear_bytes(896, 896, "q8_0") == 896 * 896 + 896 * 128 * 2
    assert quantized_linear_bytes(896, 896, "nf4") == 896 * 512 + 896 * 128 * 4
    assert quantized_linear_bytes(896, 896, "nf4") / weights > 2 * (0.5 + 4 / 64)
