"""The input checks' bound on a micro-batch: each split's own blocks (run/input_checks.py)."""

from __future__ import annotations

import pytest

from finetuning_pipeline.run.input_checks import check_micro_batches
from finetuning_pipeline.run_config import ConfigError, load_config

DEMO = "finetuning_pipeline/configs/demo.yaml"
COUNTS = {"train": 30, "eval": 2}  # the demo's phase 1


@pytest.mark.parametrize("overrides, refused", [
    (["train.micro_batch=30"], None),
    (["train.micro_batch=31"], "train.micro_batch=31: more rows than phase1.data holds (DIR: 30 training and 2 eval "
                               "blocks); a micro-batch would repeat its train blocks. Choose train.micro_batch <= 30"),
    (["train.micro_batch=32"], "train.micro_batch=32"),  # (30 training + 2 eval blocks passed it: eval is not trained)
    (["eval.micro_batch=2"], None),
    (["eval.micro_batch=3"], "eval.micro_batch=3: more rows than phase1.data holds (DIR: 30 training and 2 eval "
                             "blocks); a micro-batch would repeat its eval blocks. Choose eval.micro_batch <= 2"),
])
def test_each_micro_batch_is_bounded_by_its_own_splits_blocks(overrides, refused):
    config = load_config(DEMO, overrides)
    if refused is None:
        check_micro_batches(config, "phase1.data", "DIR", COUNTS)
    else:
        with pytest.raises(ConfigError, match=refused.replace("(", r"\(").replace(")", r"\)")):
            check_micro_batches(config, "phase1.data", "DIR", COUNTS)


def test_a_split_without_blocks_bounds_nothing():
    check_micro_batches(load_config(DEMO, ["eval.micro_batch=8"]), "phase1.data", "DIR", {"train": 30, "eval": 0})
