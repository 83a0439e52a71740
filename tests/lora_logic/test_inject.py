"""inject_lora on real Hugging Face architectures: what gets wrapped, frozen and trained."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, random_tokens, tiny_causal_lm

from lora_logic.adapters import lora_modules, lora_parameters, lora_state_dict, named_lora_parameters
from lora_logic.config import DEFAULT_TARGET_MODULES, LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_wrapped_model_equals_base_at_init(arch):
    model = tiny_causal_lm(arch)
    tokens = random_tokens()
    with torch.no_grad():
        before = model(tokens, use_cache=False).logits
    inject_lora(model, LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        after = model(tokens, use_cache=False).logits
    torch.testing.assert_close(after, before, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_trainable_set_is_exactly_the_lora_parameters(arch):
    model = tiny_causal_lm(arch)
    wrapped = inject_lora(model, LoraConfig(r=4, alpha=8))
    # 7 targets in each of the 2 layers, nothing else (lm_head and embeddings stay frozen).
    assert len(wrapped) == 2 * len(DEFAULT_TARGET_MODULES)
    assert all(isinstance(model.get_submodule(name), LoRALinear) for name in wrapped)
    # In memory, PEFT's names (the adapter's name inside); in its state dict, a PEFT file's.
    expected = {f"{name}.{ab}.weight" for name in wrapped for ab in ("lora_A", "lora_B")}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {key.replace(".weight", ".default.weight") for key in expected}
    assert [n for n, _ in named_lora_parameters(model)] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert set(lora_state_dict(model)) == expected
    assert {id(p) for p in lora_parameters(model)} == {
        id(p) for n, p in model.named_parameters() if p.requires_grad
    }


def test_suffix_match_is_by_whole_name_component():
    model = tiny_causal_lm("llama")
    wrapped = inject_lora(model, LoraConfig(r=2, alpha=2, target_modules=["q_proj", "down_proj"]))
    assert wrapped == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.down_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.down_proj",
    ]
    # A full path is a suffix of itself: exactly one layer.
    other = tiny_causal_lm("llama")
    assert inject_lora(other, LoraConfig(r=2, alpha=2, target_modules=["layers.1.mlp.up_proj"])) == [
        "model.layers.1.mlp.up_proj"
    ]


def test_unmatched_target_lists_the_linear_names():
    model = tiny_causal_lm("mistral")
    with pytest.raises(ValueError) as err:
        inject_lora(model, LoraConfig(target_modules=["q_proj", "query_key_value"]))
    message = str(err.value)
    assert "['query_key_value']" in message and "match no nn.Linear" in message
    for name in ("q_proj", "o_proj", "gate_proj", "lm_head"):
        assert name in message
    # A failed injection changes nothing.
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())


def test_partial_suffix_does_not_match():
    model = tiny_causal_lm("mistral")
    with pytest.raises(ValueError, match=r"\['proj'\]"):
        inject_lora(model, LoraConfig(target_modules=["proj"]))


def test_injecting_twice_is_an_error():
    model = tiny_causal_lm("qwen2")
    inject_lora(model, LoraConfig(r=2, alpha=2))
    with pytest.raises(ValueError, match="already has 14 LoRA layers"):
        inject_lora(model, LoraConfig(r=2, alpha=2))


def test_injected_layers_keep_the_models_train_or_eval_mode():
    model = tiny_causal_lm("mistral")  # eval mode
    inject_lora(model, LoraConfig(r=2, alpha=2, dropout=0.5))
    assert not any(m.training for m in model.modules())
    model.train()
    assert all(m.training for _, m in lora_modules(model))
