"""The LR schedule: linear warm-up that never starts at 0, then a cosine to peak * min_lr_ratio."""

from __future__ import annotations

import math

import pytest

from finetuning_pipeline.train.lr_schedule import lr_at


def test_lr_schedule():
    kw = dict(peak=1e-3, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(20)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear, never starting at 0
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # then non-increasing
    assert lrs[-1] == pytest.approx(1e-4)  # the cosine ends at peak * min_lr_ratio
    assert lrs[11] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert all(lr > 0 for lr in lrs)
