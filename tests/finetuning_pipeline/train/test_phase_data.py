"""A phase's data on a replica: what a resume on another number of devices is told when the
checkpoint's global batch cannot be kept as it is, and a global batch beyond the data refused."""

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


def test_a_global_batch_beyond_the_training_blocks_is_refused_on_every_replica(tiny_model_dir, data):
    """The micro-batch alone is bounded before the replicas start (run/input_checks.py); the
    devices that multiply it are known on the replicas: one device more than the phase's blocks,
    at micro-batch 1, would repeat a block in every step. Each replica (here the first and the
    last) refuses with the same line, naming the product, the blocks and the data; as many
    devices as blocks train."""
    from types import SimpleNamespace

    from dataset.manifest import read_manifest
    from finetuning_pipeline.errors import ConfigError
    from finetuning_pipeline.run_config import load_config
    from finetuning_pipeline.train.phase_data import PhaseData

    blocks = read_manifest(data[1])["counts"]["train"]
    config = load_config(None, ["model.path=unused", "train.micro_batch=1", "train.grad_accum=1"])

    def on(devices: int, rank: int) -> PhaseData:
        parallel = SimpleNamespace(chips=devices, chips_per_process=1, rank=rank, world=devices)
        return PhaseData({"": str(data[1])}, train=config.train, eval=config.eval, parallel=parallel, phase=1)

    lines = set()
    for rank in (0, blocks):
        with pytest.raises(ConfigError) as refused:
            on(blocks + 1, rank)
        lines.add(str(refused.value))
    [line] = lines
    assert line == (f"phase 1: a global batch of {blocks + 1} sequences a step (train.micro_batch 1 x "
                    f"train.grad_accum 1 x {blocks + 1} devices) is more than the {blocks} training blocks of "
                    f"{data[1]}: every step would repeat blocks. Choose train.micro_batch x train.grad_accum x "
                    f"devices <= {blocks}, or prepare more data")
    assert on(blocks, 0).batches_per_step == blocks
