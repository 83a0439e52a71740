"""What the native runtime's parallelize does to a phase's model, and says of it."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.run_config import load_config
from finetuning_pipeline.runtime.native.runtime import NativeRuntime

pytestmark = pytest.mark.native
DEMO = "finetuning_pipeline/configs/demo.yaml"


@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_fsdp_in_one_process_says_it_shards_nothing(mode):
    """FSDP2 shards over torchrun's processes: in one process nothing is sharded, and the phase's line
    says so (the summary's sharded_base_parameters is 0), rather than nothing at all."""
    config = load_config(DEMO, ["runtime.backend=native", f"parallel.mode={mode}"])
    done = NativeRuntime(torch.device("cpu"), compile_layers=False).parallelize(
        tiny_causal_lm("mistral"), config, Parallel(mode), torch.device("cpu"), seq_len=64)
    assert done.sharded == [] and not done.scanned_layers
    assert done.description.startswith("not a TPU: dense attention; native runtime on cpu: decoder layers run one")
    said = "parallel.mode=fsdp in one process shards nothing: FSDP2 shards over torchrun's processes"
    assert (said in done.description) == (mode == "fsdp")
