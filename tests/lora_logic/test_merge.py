"""merge_lora / unmerge_lora, and what training may and may not touch."""

from __future__ import annotations

import pytest
import torch
from conftest import random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from lora_logic.adapters import lora_modules, lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from lora_logic.layer import LoRALinear
from lora_logic.merge import merge_and_unload, merge_lora, unmerge_lora
from utils.precision import float64_throughout


def trained_model(arch: str = "mistral", steps: int = 3, dtype: torch.dtype = torch.float32):
    """A tiny model with LoRA after a few real AdamW steps, so B A is not zero. float64 for the
    claims that a merged model computes what the unmerged one does: W0 x + s B (A x) and
    (W0 + s B A) x are equal in exact arithmetic, not in rounding (tests/tolerances.py)."""
    model = tiny_causal_lm(arch).to(dtype)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2)
    tokens = random_tokens(seq=16)
    for _ in range(steps):
        with float64_throughout(dtype):
            loss = model(tokens, labels=tokens, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, tokens


def base_weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}


def test_base_weights_bitwise_unchanged_after_optimizer_steps():
    model = tiny_causal_lm("mistral")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    inject_lora(model, LoraConfig(r=4, alpha=8))
    optimizer = torch.optim.AdamW(lora_parameters(model), lr=1e-2, weight_decay=0.1)
    tokens = random_tokens(seq=16)
    b_before = [m.lora_B["default"].weight.detach().clone() for _, m in lora_modules(model)]
    for _ in range(3):
        model(tokens, labels=tokens, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = {n.replace(".base_layer", ""): p for n, p in model.named_parameters() if "lora_" not in n}
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    # ...while the adapter did move.
    assert any(not torch.equal(m.lora_B["default"].weight, b) for (_, m), b in zip(lora_modules(model), b_before))


def test_merged_equals_unmerged_and_merge_is_idempotent():
    model, tokens = trained_model(dtype=torch.float64)
    with torch.no_grad(), float64_throughout(torch.float64):
        unmerged = model(tokens, use_cache=False).logits
        assert merge_lora(model) == 14
        merged = model(tokens, use_cache=False).logits
        weights_once = base_weights(model)
        assert merge_lora(model) == 0  # a second merge changes nothing
        merged_twice = model(tokens, use_cache=False).logits
    assert_equal_in_exact_arithmetic(merged, unmerged, "merged logits")
    assert torch.equal(merged_twice, merged)
    for name, tensor in base_weights(model).items():
        assert torch.equal(tensor, weights_once[name]), name
    assert all(m.merged for _, m in lora_modules(model))


def test_unmerge_restores_the_base():
    model, tokens = trained_model(dtype=torch.float64)
    original = base_weights(model)
    with torch.no_grad(), float64_throughout(torch.float64):
        before = model(tokens, use_cache=False).logits
        merge_lora(model)
        assert any(not torch.equal(p, original[n]) for n, p in base_weights(model).items())
        assert unmerge_lora(model) == 14
        assert unmerge_lora(model) == 0
        after = model(tokens, use_cache=False).logits
    for name, tensor in base_weights(model).items():
        assert_equal_in_exact_arithmetic(tensor, original[name], f"{name} unmerged")
    assert_equal_in_exact_arithmetic(after, before, "unmerged logits")


def test_merge_refuses_nan_and_leaves_every_base_weight_untouched():
    model, _ = trained_model()
    original = base_weights(model)
    name, last = list(lora_modules(model))[-1]
    with torch.no_grad():
        last.lora_B["default"].weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=f"NaN/inf.*{name}"):
        merge_lora(model)
    for key, tensor in base_weights(model).items():
        assert torch.equal(tensor, original[key]), key
    assert not any(m.merged for _, m in lora_modules(model))


def test_layer_merge_refuses_finite_weights_whose_product_overflows():
    model, _ = trained_model()
    _, layer = next(iter(lora_modules(model)))
    with torch.no_grad():
        layer.lora_A["default"].weight.fill_(1.0)
        layer.lora_B["default"].weight.fill_(1e38)  # every weight finite; scaling * B A = 2 * 4e38 = inf
    before = layer.base_layer.weight.clone()
    with pytest.raises(ValueError, match="refusing to merge"):
        layer.merge()
    assert torch.equal(layer.base_layer.weight, before) and not layer.merged


def test_merge_without_lora_is_an_error():
    with pytest.raises(ValueError, match="no LoRA layers"):
        merge_lora(tiny_causal_lm("llama"))


def test_merge_and_unload_gives_a_plain_model_with_the_same_output():
    model, tokens = trained_model(dtype=torch.float64)
    with torch.no_grad(), float64_throughout(torch.float64):
        expected = model(tokens, use_cache=False).logits
    assert merge_and_unload(model) == 14
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    plain_keys = set(tiny_causal_lm("mistral").state_dict())
    assert set(model.state_dict()) == plain_keys  # original key names, no base_layer / lora_*
    with torch.no_grad(), float64_throughout(torch.float64):
        assert_equal_in_exact_arithmetic(model(tokens, use_cache=False).logits, expected, "merged logits")
    inject_lora(model, LoraConfig(r=2, alpha=2))  # a fresh adapter can start on the merged model
