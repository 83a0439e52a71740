"""Adapters on disk: PEFT's layout, exact round trips, loud failures, and PEFT itself reading them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_tokens, tiny_causal_lm
from safetensors.torch import load_file, save_file
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapter_io import load_adapters, save_adapters
from lora_logic.adapters import lora_modules, lora_state_dict
from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.inject import inject_lora
from utils.precision import float64_throughout

REQUIRED_FIELDS = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "bias": "none",
    "fan_in_fan_out": False,
    "use_dora": False,
    "modules_to_save": None,
}


def adapted_model(config: LoraConfig, arch: str = "mistral", dtype: torch.dtype = torch.float32):
    """A tiny model with LoRA whose A and B are both random (so nothing hides behind B = 0)."""
    model = tiny_causal_lm(arch).to(dtype)
    inject_lora(model, config)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_B["default"].weight.copy_(torch.randn(m.lora_B["default"].weight.shape, generator=generator) * 0.1)
    return model


def test_round_trip_is_exact_with_peft_keys_and_config(tmp_path):
    config = LoraConfig(r=4, alpha=16, dropout=0.05, target_modules=["q_proj", "v_proj"], use_rslora=True)
    model = adapted_model(config)
    save_adapters(model, tmp_path, config, base_model_name_or_path="org/tiny-mistral")

    saved = json.loads((tmp_path / "adapter_config.json").read_text())
    assert saved.items() >= REQUIRED_FIELDS.items()
    assert saved["base_model_name_or_path"] == "org/tiny-mistral"
    assert (saved["r"], saved["lora_alpha"], saved["lora_dropout"]) == (4, 16, 0.05)
    assert saved["target_modules"] == ["q_proj", "v_proj"] and saved["use_rslora"] is True

    tensors = load_file(tmp_path / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight"].shape == (4, 32)
    assert tensors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].shape == (16, 4)  # 2 kv heads x 8
    assert len(tensors) == 2 * 2 * 2  # 2 layers x 2 targets x (A, B)

    fresh = tiny_causal_lm("mistral")
    loaded = load_adapters(fresh, tmp_path)  # injects from the adapter's own config
    assert loaded == {DEFAULT_ADAPTER: config}
    ours, theirs = lora_state_dict(model), lora_state_dict(fresh)
    assert ours.keys() == theirs.keys()
    for key in ours:
        assert torch.equal(ours[key], theirs[key]), key
    tokens = random_tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens, use_cache=False).logits, fresh(tokens, use_cache=False).logits)


def test_no_temporary_files_left_behind(tmp_path):
    config = LoraConfig(r=2, alpha=2)
    save_adapters(adapted_model(config), tmp_path, config, "base")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture
def saved_adapter(tmp_path):
    config = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "o_proj"])
    save_adapters(adapted_model(config), tmp_path, config, "base")
    return tmp_path


def rewrite_weights(directory, edit):
    path = directory / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(saved_adapter):
    rewrite_weights(saved_adapter, lambda t: t.pop("base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"))
    with pytest.raises(ValueError, match=r"1 missing: base_model\.model\.model\.layers\.1\.self_attn\.o_proj\.lora_B"):
        load_adapters(tiny_causal_lm("mistral"), saved_adapter)


def test_unexpected_tensor_is_named(saved_adapter):
    rewrite_weights(saved_adapter, lambda t: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 32)}))
    with pytest.raises(ValueError, match=r"1 unexpected: base_model\.model\.lm_head\.lora_A\.weight"):
        load_adapters(tiny_causal_lm("mistral"), saved_adapter)


def test_misshapen_tensor_is_named_and_nothing_is_loaded(saved_adapter):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    rewrite_weights(saved_adapter, lambda t: t.update({key: torch.zeros(4, 31)}))
    model = tiny_causal_lm("mistral")
    inject_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "o_proj"]))
    before = {k: v.clone() for k, v in lora_state_dict(model).items()}
    with pytest.raises(ValueError, match=r"1 misshapen: .*q_proj\.lora_A\.weight: file \(4, 31\) vs model \(4, 32\)"):
        load_adapters(model, saved_adapter)
    for k, v in lora_state_dict(model).items():
        assert torch.equal(v, before[k]), k


def test_rank_mismatch_with_an_injected_model(saved_adapter):
    model = tiny_causal_lm("mistral")
    inject_lora(model, LoraConfig(r=8, alpha=8, target_modules=["q_proj", "o_proj"]))
    with pytest.raises(ValueError, match="r=4.*has r=8"):
        load_adapters(model, saved_adapter)


def test_missing_directory_and_bad_json(tmp_path, saved_adapter):
    with pytest.raises(FileNotFoundError, match="adapter_config.json: no adapter config here"):
        load_adapters(tiny_causal_lm("mistral"), tmp_path / "nowhere")
    (saved_adapter / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="adapter_config.json: not valid JSON"):
        load_adapters(tiny_causal_lm("mistral"), saved_adapter)


def test_missing_weights_file(saved_adapter):
    (saved_adapter / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors: adapter weights are missing"):
        load_adapters(tiny_causal_lm("mistral"), saved_adapter)


@pytest.mark.parametrize(
    "field, value, message",
    [("use_dora", True, "use_dora=True is not supported"), ("target_modules", ".*proj", "regular expression")],
)
def test_unsupported_peft_features_are_refused(saved_adapter, field, value, message):
    path = saved_adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    config[field] = value
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_adapters(tiny_causal_lm("mistral"), saved_adapter)


# PEFT is a test-only dependency: these prove the files work in the tool users serve with.
@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_loads_our_adapter_with_identical_logits(tmp_path, use_rslora):
    peft = pytest.importorskip("peft")
    """In float64 (tests/tolerances.py): PEFT's forward and ours are equal in exact arithmetic;
    PEFT also reads a float64 adapter, which model.dtype=float64 writes."""
    config = LoraConfig(r=4, alpha=8, use_rslora=use_rslora)
    ours = adapted_model(config, dtype=torch.float64)
    save_adapters(ours, tmp_path, config, "tiny-mistral")
    theirs = peft.PeftModel.from_pretrained(tiny_causal_lm("mistral").to(torch.float64), tmp_path).eval()
    assert all(p.dtype == torch.float64 for n, p in theirs.named_parameters() if "lora_" in n)
    tokens = random_tokens()
    with torch.no_grad(), float64_throughout(torch.float64):
        assert_equal_in_exact_arithmetic(theirs(tokens, use_cache=False).logits, ours(tokens, use_cache=False).logits,
                                         "PEFT's logits")


def test_we_load_an_adapter_peft_saved(tmp_path):
    peft = pytest.importorskip("peft")
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "gate_proj"], task_type="CAUSAL_LM")
    theirs = peft.get_peft_model(tiny_causal_lm("llama").to(torch.float64), peft_config)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    theirs.save_pretrained(tmp_path)
    ours = tiny_causal_lm("llama").to(torch.float64)
    load_adapters(ours, tmp_path)
    tokens = random_tokens()
    with torch.no_grad(), float64_throughout(torch.float64):
        assert_equal_in_exact_arithmetic(ours(tokens, use_cache=False).logits,
                                         theirs.eval()(tokens, use_cache=False).logits, "PEFT's logits")
