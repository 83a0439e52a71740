"""Attention masks of packed sequences: each segment attends to itself only."""

from __future__ import annotations

import torch

from finetuning_pipeline.model.attention_masks import allowed_positions, as_attention_mask


def test_block_causal_mask_keeps_packed_segments_apart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = allowed_positions(6, "cpu", None, positions)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    additive = as_attention_mask(allowed_positions(6, "cpu", None, positions), torch.float32, sdpa=False)[0, 0]
    assert torch.equal(additive == 0, expected)
