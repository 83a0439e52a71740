"""QuantizedLinear under the LoRA: it computes what an nn.Linear holding its dequantized weight
computes, forward and backward (the LoRA's gradients and the input's), on the host and on the
XLA device; its backward keeps no dequantized weight from the forward; a merge into it is refused."""

from __future__ import annotations

import pytest
import torch
import torch_xla
from tolerances import assert_equal_in_exact_arithmetic
from torch import nn

from lora_logic.config import DEFAULT_ADAPTER, LoraConfig
from lora_logic.layer import LoRALinear
from lora_logic.quantized_linear import QuantizedLinear

FORMATS = ["q8_0", "q4_0", "nf4"]


def pair(fmt: str, bias: bool = True, dtype: torch.dtype = torch.float32) -> tuple[LoRALinear, LoRALinear]:
    """The LoRA over a quantized Linear, and the same LoRA over an nn.Linear holding the
    dequantized weight; B random so both LoRA matrices get gradients."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(dtype)
    quantized = QuantizedLinear.from_linear(linear, fmt)
    with torch.no_grad():
        linear.weight.copy_(quantized.dequantized_weight())
    layers = []
    for base in (quantized, linear):
        torch.manual_seed(1)
        layer = LoRALinear(base)
        layer.add_adapter(DEFAULT_ADAPTER, LoraConfig(r=4, alpha=8))
        with torch.no_grad():
            layer.lora_B[DEFAULT_ADAPTER].weight.normal_(std=0.1)
        layers.append(layer)
    return layers[0], layers[1]


def forward_backward(layer: LoRALinear, x: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = layer(x)
    (y.square().sum()).backward()
    assert x.grad is not None  # the gradient reaching the activations: never None
    return {"y": y, "x.grad": x.grad, "A.grad": layer.lora_A[DEFAULT_ADAPTER].weight.grad,
            "B.grad": layer.lora_B[DEFAULT_ADAPTER].weight.grad}


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_lora_over_a_quantized_linear_equals_it_over_the_dequantized_weight(fmt):
    quantized, reference = pair(fmt)
    x = torch.randn(3, 5, 64)
    got, want = forward_backward(quantized, x), forward_backward(reference, x)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert not any(p.requires_grad for p in quantized.base_layer.parameters())


@pytest.mark.parametrize("fmt", FORMATS)
def test_on_the_xla_device_too_with_the_activations_gradient(fmt):
    """XLA fuses the dequantization into other sums than the plain matmul's: equal in exact
    arithmetic, so float64 (tests/tolerances.py)."""
    device = torch_xla.device()
    results = []
    for layer in pair(fmt, dtype=torch.float64):
        layer.to(device)
        x = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
        out = forward_backward(layer, x.to(device))
        torch_xla.sync()
        results.append({key: value.cpu() for key, value in out.items()})
    for key in results[1]:
        assert results[0][key].dtype == torch.float64, key
        assert_equal_in_exact_arithmetic(results[0][key], results[1][key], f"{fmt} {key}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_backward_keeps_the_codes_and_scales_not_the_dequantized_weight(fmt):
    # F.linear's autograd would save the dequantized weight of every layer until the backward:
    # as much memory as the unquantized weights, given back.
    quantized, reference = pair(fmt)
    saved = {"quantized": [], "reference": []}
    for key, layer in (("quantized", quantized), ("reference", reference)):
        with torch.autograd.graph.saved_tensors_hooks(lambda t, key=key: saved[key].append(t) or t, lambda t: t):
            forward_backward(layer, torch.randn(3, 5, 64))
    def weights(tensors):  # as stored or transposed
        return [t for t in tensors if t.is_floating_point() and sorted(t.shape) == [48, 64]]

    assert weights(saved["reference"])  # the control: a plain Linear keeps its weight for the input's gradient
    assert not weights(saved["quantized"])
    base = quantized.base_layer
    assert any(t is base.codes for t in saved["quantized"]) and any(t is base.scales for t in saved["quantized"])


def test_on_the_xla_device_the_backward_dequantizes_behind_a_barrier_with_the_gradient():
    # Without it XLA would merge the backward's dequantization with the forward's (the same
    # expression) and keep that weight alive in between, which is what the line above avoids.
    layer, _ = pair("q4_0")
    layer.to(torch_xla.device())
    out = forward_backward(layer, torch.randn(3, 5, 64).to(torch_xla.device()))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out["x.grad"]])
    barriers = [line.split("opt-barrier(")[0] for line in hlo.splitlines() if "opt-barrier(" in line]
    codes, scales = layer.base_layer.codes, layer.base_layer.scales
    # The backward's, with the incoming gradient; and the forward's, with its input (without it
    # XLA moves the forward's dequantization out of the micro-batch loop).
    assert len(barriers) == 2
    packed = (f"u8[{codes.shape[0]},{codes.shape[1]}]", f"f16[{scales.shape[0]},{scales.shape[1]}]")
    backward = [b for b in barriers if "f32[3,5,48]" in b]
    forward = [b for b in barriers if "f32[3,5,64]" in b]
    assert len(backward) == len(forward) == 1
    for shape in packed:
        assert shape in backward[0] and shape in forward[0], (shape, barriers)
    assert layer.base_layer.codes is codes  # the barrier rewrote copies, not the module's buffers


def test_bf16_compute_dequantizes_in_fp32_and_casts_once():
    linear = nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    quantized = QuantizedLinear.from_linear(linear, "q4_0")
    assert quantized.dequantized_weight().dtype == torch.bfloat16
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    reference = quantized.dequantized_weight()
    assert torch.equal(quantized(x), nn.functional.linear(x, reference))


def test_a_merge_into_a_quantized_base_is_refused_saying_what_to_do():
    quantized, _ = pair("q8_0")
    with pytest.raises(ValueError, match="cannot merge into a q8_0 base.*full-precision weights"):
        quantized.merge()


def test_adapters_side_by_side_over_a_quantized_base_each_give_their_rows_what_alone_they_would():
    torch.manual_seed(0)  # float64: K adapters' rows in one batch against one's (tests/tolerances.py)
    quantized = QuantizedLinear.from_linear(nn.Linear(64, 48).double(), "nf4")
    configs = {"a": LoraConfig(r=4, alpha=8), "b": LoraConfig(r=2, alpha=2)}
    together = LoRALinear(quantized, list(configs))
    for name, config in configs.items():
        together.add_adapter(name, config)
        with torch.no_grad():
            together.lora_B[name].weight.normal_(std=0.1)
    x = torch.randn(4, 3, 64, dtype=torch.float64)
    y = together(x)
    for k, (name, config) in enumerate(configs.items()):
        alone = LoRALinear(quantized, [name])
        alone.add_adapter(name, config)
        alone.load_state_dict(together.state_dict(), strict=False)
        assert_equal_in_exact_arithmetic(y[2 * k:2 * k + 2], alone(x[2 * k:2 * k + 2]), f"adapter {name}'s rows")


def test_on_the_xla_device_nf4_codes_become_values_by_selects_not_a_per_value_gather():
    """Each of the 256 bytes (two nibbles) gives the table's values bit for bit, and the graph
    that dequantizes holds no gather (a lookup would be one gather entry per weight value)."""
    from lora_logic.quantize import QuantizedWeight, dequantize, nf4_code_tensor

    codes = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # 8 rows of one 64-value block
    scales = torch.rand(8, 1, generator=torch.Generator().manual_seed(0)) + 0.5
    weight = QuantizedWeight("nf4", (8, 64), codes, scales)
    on_host = dequantize(weight, nf4_code=nf4_code_tensor())
    device = torch_xla.device()
    on_xla = dequantize(QuantizedWeight("nf4", (8, 64), codes.to(device), scales.to(device)),
                        nf4_code=nf4_code_tensor(device))
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([on_xla])
    assert " gather(" not in hlo and "select(" in hlo
    assert torch.equal(on_xla.cpu(), on_host)
    # the control: the host path's lookup, traced on the device, is the gather this replaces
    lookup = nf4_code_tensor(device)[codes.to(device).int() & 15]
    assert " gather(" in torch_xla._XLAC._get_xla_tensors_hlo([lookup])


@pytest.mark.parametrize("fmt", FORMATS)
def test_codes_held_as_float16_bits_compute_bitwise_what_they_did(fmt):
    """hold_codes_as (FSDP2 shards floating-point parameters only): the codes' bits kept whole, every
    bit pattern an int8 or uint8 can take included (some are float16 NaNs), and the LoRA over the
    layer computes bitwise what it did; a last dimension that fills no whole float16 is left alone."""
    quantized, _ = pair(fmt)
    base = quantized.base_layer
    with torch.no_grad():  # every byte value, so that NaN patterns go through too
        base.codes.view(-1)[:256] = torch.arange(256, dtype=torch.uint8).view(base.codes.dtype)
    codes, x = base.codes.clone(), torch.randn(3, 64)
    before = forward_backward(quantized, x)
    quantized.zero_grad()
    assert base.hold_codes_as(torch.float16)
    assert isinstance(base.codes, nn.Parameter) and base.codes.dtype == torch.float16 and "codes" not in dict(
        base.named_buffers()) and not base.codes.requires_grad and not base.scales.requires_grad
    assert torch.equal(base.codes.view(codes.dtype), codes)
    after = forward_backward(quantized, x)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    odd = QuantizedLinear.from_linear(nn.Linear(32, 8), "q8_0")
    odd.codes = odd.codes[..., :1].contiguous()  # one byte a row
    assert not odd.hold_codes_as(torch.float16) and "codes" in dict(odd.named_buffers())
