"""A frozen copy of an adapter beside it in the same layers (LoRALinear.add_frozen_copy): a
preference phase's reference. Routed through, it is the adapter as it was copied; it trains
nothing, is in no optimizer and no adapter's state, and the model's rows never go through it
unless routed there."""

from __future__ import annotations

import pytest
import torch
from conftest import random_tokens, tiny_causal_lm

from lora_logic.adapters import (
    adapter_names,
    lora_modules,
    lora_parameters,
    lora_state_dict,
    only_adapter,
    per_layer_lora_names,
)
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


@pytest.fixture
def model():
    model = tiny_causal_lm("qwen2").to(torch.float64)
    inject_lora(model, LoraConfig(r=4, alpha=8, dropout=0.2))
    with torch.no_grad():
        for _, module in lora_modules(model):
            module.lora_B["default"].weight.normal_(std=0.1, generator=torch.Generator().manual_seed(0))
            module.add_frozen_copy("default", "reference")
    return model


def test_routed_through_it_the_copy_is_the_adapter_as_it_was_copied(model):
    tokens = random_tokens()
    model.eval()
    with torch.no_grad():
        before = model(tokens).logits
        with only_adapter(model, "reference"):
            assert torch.equal(model(tokens).logits, before)
        for parameter in lora_parameters(model):  # train the adapter: the copy stays as it was
            parameter.add_(0.05)
        moved = model(tokens).logits
        with only_adapter(model, "reference"):
            assert torch.equal(model(tokens).logits, before)
    assert not torch.allclose(moved, before)


def test_it_trains_nothing_and_is_no_adapter_of_the_model(model):
    names = [name for name, _ in model.named_parameters() if ".reference." in name]
    assert names and not any(p.requires_grad for n, p in model.named_parameters() if ".reference." in n)
    assert adapter_names(model) == ["default"]
    assert not any(".reference." in name for name in per_layer_lora_names(model))
    assert len(lora_parameters(model)) == len(per_layer_lora_names(model)) == len(lora_state_dict(model))
    for _, module in lora_modules(model):
        assert module.adapters == ["default"] and module.r["reference"] == module.r["default"]
        assert isinstance(module.lora_dropout["reference"], torch.nn.Identity)  # the reference drops nothing


def test_a_second_copy_of_the_same_name_or_of_a_trained_adapter_is_refused(model):
    _, module = next(lora_modules(model))
    for name in ("reference", "default"):
        with pytest.raises(ValueError, match=f"adapter '{name}': already here"):
            module.add_frozen_copy("default", name)
