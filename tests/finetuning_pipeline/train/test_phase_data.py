"""A phase's data on a replica: what a resume on another number of devices is told when the
checkpoint's global batch cannot be kept as it is."""

from __future__ import annotations

import pytest

from finetuning_pipeline.train.phase_data import global_batch_advice

pytestmark = pytest.mark.native


def test_devices_that_do_not_divide_the_global_batch_are_told_which_counts_do():
    """3 processes resuming a global batch of 16: no micro-batch and accumulation make 16 on 3, so
    the advice is the process counts that divide it, not a product that cannot be set."""
    advice = global_batch_advice(16, 3, micro_batch=4)
    assert advice == "16 is not a multiple of 3 devices: resume on a number of devices that divides it (1, 2, 4, 8, 16)"


SETTING = "set train.micro_batch x train.grad_accum to {} on {} devices (e.g. train.micro_batch={} train.grad_accum={})"


@pytest.mark.parametrize("saved, devices, micro_batch, expected", [
    (16, 2, 4, SETTING.format(8, 2, 4, 2)),
    (16, 4, 8, SETTING.format(4, 4, 4, 1)),
    (12, 1, 5, SETTING.format(12, 1, 4, 3)),
])
def test_devices_that_divide_it_are_given_a_setting_that_makes_it(saved, devices, micro_batch, expected):
    """The example keeps the micro-batch where it fits (the memory it was sized for), else the largest
    that divides the per-device share; its product times the devices is the saved batch."""
    advice = global_batch_advice(saved, devices, micro_batch)
    assert advice == expected
    numbers = [int(part.split("=")[1].rstrip(")")) for part in advice.split("(e.g. ")[1].split()]
    assert numbers[0] * numbers[1] * devices == saved
