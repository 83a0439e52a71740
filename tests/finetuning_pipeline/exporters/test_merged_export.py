"""`python -m finetuning_pipeline.export --format hf`: the merged model in the base's own dtype
unless --dtype names another, merged in at least fp32 (float64 for a float64 base)."""

from __future__ import annotations

import json

import pytest
import torch
from gguf_models import write_family_model, write_random_adapter
from safetensors import safe_open
from tolerances import assert_equal_in_exact_arithmetic
from transformers import AutoModelForCausalLM

from finetuning_pipeline import export
from lora_logic.adapter_io import read_adapter_config, read_adapter_weights


def saved_tensors(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


@pytest.mark.parametrize("stored, flags, saved", [
    (torch.bfloat16, [], torch.bfloat16),  # "auto": the base's dtype, not the fp32 it was merged in
    (torch.float64, [], torch.float64),
    (torch.bfloat16, ["--dtype", "float32"], torch.float32),
])
def test_the_merged_model_is_saved_in_the_base_s_dtype_unless_told(tmp_path, stored, flags, saved):
    base = write_family_model(tmp_path / "base", "llama")
    AutoModelForCausalLM.from_pretrained(base, dtype=stored).save_pretrained(base)  # the base, stored in `stored`
    adapter = write_random_adapter(tmp_path / "adapter", base, "llama", seed=1)
    assert export.main(["--base", str(base), "--adapter", str(adapter), "--out", str(tmp_path / "merged"), *flags]) == 0
    tensors = saved_tensors(tmp_path / "merged")
    assert tensors and {t.dtype for t in tensors.values()} == {saved}
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["dtype"] == str(saved).removeprefix("torch.")
    if stored == torch.float64:  # merged in float64: W0 + s B A exactly as float64 computes it
        scaling = read_adapter_config(adapter)[0].scaling
        base_tensors = saved_tensors(base)
        for module, (lora_a, lora_b) in read_adapter_weights(adapter).items():
            key = module.removeprefix("model.") + ".weight"
            key = next(k for k in tensors if k.endswith(key))
            expected = base_tensors[key] + scaling * (lora_b.double() @ lora_a.double())
            assert_equal_in_exact_arithmetic(tensors[key], expected, f"merged {key}")
