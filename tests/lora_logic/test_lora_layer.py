"""LoRALinear: the formula, the init, the scaling, dropout and dtypes."""

from __future__ import annotations

import math

import pytest
import torch
from tolerances import assert_equal_in_exact_arithmetic
from torch import nn

from lora_logic.config import DEFAULT_ADAPTER, LoraConfig, lora_scaling
from lora_logic.layer import LoRALinear


def with_adapter(base: nn.Module, **config) -> LoRALinear:
    """`base` wrapped with one adapter of `config` (LoraConfig's fields): a model's only adapter."""
    layer = LoRALinear(base)
    layer.add_adapter(DEFAULT_ADAPTER, LoraConfig(**config))
    return layer


def test_forward_matches_hand_computed_value():
    # W0 x + b0 + (alpha/r) B A x, every number small enough to check on paper.
    base = nn.Linear(2, 2)
    with torch.no_grad():
        base.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        base.bias.copy_(torch.tensor([0.5, -0.5]))
    layer = with_adapter(base, r=1, alpha=2.0)  # scaling 2
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, -1.0]]))  # [r=1, in=2]
        layer.lora_B["default"].weight.copy_(torch.tensor([[2.0], [3.0]]))  # [out=2, r=1]
    x = torch.tensor([[1.0, 3.0]])
    # W0 x + b = [1+6+0.5, 3+12-0.5] = [7.5, 14.5]; A x = -2; B A x = [-4, -6]; times 2 = [-8, -12]
    torch.testing.assert_close(layer(x), torch.tensor([[-0.5, 2.5]]), rtol=0, atol=0)


def test_init_equals_base_and_follows_kaiming_and_zeros(seed):
    base = nn.Linear(64, 48)
    layer = with_adapter(base, r=8, alpha=16)
    assert layer.lora_A["default"].weight.shape == (8, 64)
    assert layer.lora_B["default"].weight.shape == (48, 8)
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
    # kaiming_uniform_(a=sqrt(5)) on fan_in 64 draws from U(-1/sqrt(64), 1/sqrt(64)).
    bound = 1 / math.sqrt(64)
    assert layer.lora_A["default"].weight.abs().max() <= bound
    assert layer.lora_A["default"].weight.abs().max() > 0.9 * bound  # 512 draws: it really spans the range
    x = torch.randn(3, 5, 64)
    torch.testing.assert_close(layer(x), base(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    "r, alpha, rslora, expected",
    [(8, 16, False, 2.0), (16, 16, False, 1.0), (16, 16, True, 4.0), (4, 8, True, 4.0), (64, 16, True, 2.0)],
)
def test_scaling_with_and_without_rslora(r, alpha, rslora, expected):
    assert lora_scaling(alpha, r, rslora) == expected
    assert LoraConfig(r=r, alpha=alpha, use_rslora=rslora).scaling == expected
    layer = with_adapter(nn.Linear(4, 4).double(), r=r, alpha=alpha, use_rslora=rslora)  # float64: tolerances.py
    assert layer.scaling == {DEFAULT_ADAPTER: expected}
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    x = torch.randn(2, 4, dtype=torch.float64)
    branch = x @ layer.lora_A["default"].weight.T @ layer.lora_B["default"].weight.T
    assert_equal_in_exact_arithmetic(layer(x) - layer.base_layer(x), expected * branch, "the LoRA branch")


def test_dropout_applies_to_lora_branch_only(seed):
    layer = with_adapter(nn.Linear(16, 16), r=4, alpha=4, dropout=0.5).train()
    x = torch.randn(8, 16)
    # B = 0: the branch contributes nothing, so with the base path undropped the output is exact.
    torch.testing.assert_close(layer(x), layer.base_layer(x), rtol=0, atol=0)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    assert not torch.equal(layer(x), layer(x))  # dropout is live in train mode...
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x), rtol=0, atol=0)  # ...and off in eval mode


def test_bf16_base_keeps_fp32_lora_weights_and_grads(seed):
    layer = with_adapter(nn.Linear(32, 32).to(torch.bfloat16), r=4, alpha=8)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_()
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    y = layer(x)
    assert y.dtype == torch.bfloat16  # the activation dtype flows through
    y.float().sum().backward()
    assert layer.lora_A["default"].weight.grad.dtype == torch.float32
    assert layer.lora_B["default"].weight.grad.dtype == torch.float32
    assert layer.base_layer.weight.grad is None


def test_wraps_only_linear_and_freezes_base():
    with pytest.raises(TypeError, match="wraps nn.Linear"):
        with_adapter(nn.Conv1d(2, 2, 1), r=1, alpha=1)
    layer = with_adapter(nn.Linear(4, 4), r=2, alpha=2)
    trainable = [n for n, p in layer.named_parameters() if p.requires_grad]
    assert trainable == ["lora_A.default.weight", "lora_B.default.weight"]


@pytest.mark.parametrize(
    "kwargs, key",
    [
        (dict(r=0), "lora.r"),
        (dict(r=2.5), "lora.r"),
        (dict(alpha=0), "lora.alpha"),
        (dict(dropout=1.0), "lora.dropout"),
        (dict(target_modules=[]), "lora.target_modules"),
        (dict(target_modules=["q_proj", "q_proj"]), "duplicates"),
        (dict(use_rslora="yes"), "lora.use_rslora"),
    ],
)
def test_config_validation_names_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key):
        LoraConfig(**kwargs)


def test_on_the_xla_device_b_gradient_is_the_r_by_out_product_behind_a_barrier():
    # XLA would otherwise fold the transpose into the product and compute dy^T h [out, r], the
    # form XLA:CPU runs about 3x slower (docs/benchmarks.md); the value is the same either way.
    import torch_xla

    layer = with_adapter(nn.Linear(64, 48), r=8, alpha=16).to(torch_xla.device())
    layer(torch.randn(3, 5, 64).to(torch_xla.device())).sum().backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([layer.lora_B["default"].weight.grad])
    dots = [line.split(" = ")[1].split(" ")[0] for line in hlo.splitlines() if " dot(" in line]
    assert "opt-barrier(" in hlo
    assert any(shape.startswith("f32[8,48]") for shape in dots), dots
    assert not any(shape.startswith("f32[48,8]") for shape in dots), dots
