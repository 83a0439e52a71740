"""Activation checkpointing on XLA: the same gradients, and a real recompute in the graph, of a
quantized base's dequantized weights too. The gradients are compared in float64: XLA may fuse
the recompute into other sums than the forward's (tests/tolerances.py)."""

from __future__ import annotations

import pytest
import torch
import torch_xla
from conftest import ARCHITECTURES, random_tokens, tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing
from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum
from finetuning_pipeline.model.quantized_base import quantize_base
from lora_logic.adapters import lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora
from utils.precision import float64_throughout


def lora_grads(arch: str, checkpointed: bool, quantize: str | None = None) -> tuple[list[torch.Tensor], str]:
    model = tiny_causal_lm(arch).to(torch.float64)
    if quantize:
        quantize_base(model, quantize)
    inject_lora(model, LoraConfig(r=4, alpha=8))
    torch.manual_seed(3)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # nonzero B, so A's gradients are not trivially zero
            torch.nn.init.normal_(param, std=0.1)
    if checkpointed:
        assert enable_activation_checkpointing(model) == 2  # both decoder layers
    device = torch_xla.device()
    model.to(device).train()
    tokens = random_tokens(batch=2, seq=16).to(device)
    with float64_throughout(torch.float64):  # (the recompute keeps it: activation_checkpointing.py)
        loss, _ = causal_lm_loss_sum(model, {"input_ids": tokens, "labels": tokens}, packed=False)
        loss.backward()
    grads = [p.grad for p in lora_parameters(model)]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    torch_xla.sync()  # one graph; .cpu() of each pending tensor would compile one per tensor
    return [g.cpu() for g in grads], hlo


@pytest.mark.heavy
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpointing_gives_the_same_gradients(arch):
    plain, plain_hlo = lora_grads(arch, checkpointed=False)
    checkpointed, hlo = lora_grads(arch, checkpointed=True)
    assert len(plain) == len(checkpointed) == 2 * 7 * 2
    for reference, ours in zip(plain, checkpointed):
        assert reference.abs().max() > 0
        assert_equal_in_exact_arithmetic(ours, reference, "checkpointed gradient")
    # torch_xla's checkpoint fences the recomputed inputs (a layer's hidden states [2, 16, 32])
    # so XLA cannot merge the recompute back into the forward (torch.utils.checkpoint would be
    # silently undone). (The LoRA's own barriers, around B's gradient, are in both graphs.)
    assert hidden_state_barriers(hlo) and not hidden_state_barriers(plain_hlo)


def hidden_state_barriers(hlo: str) -> list[str]:
    barriers = [line.split("opt-barrier(")[0] for line in hlo.splitlines() if "opt-barrier(" in line]
    return [b for b in barriers if "f64[2,16,32]" in b]


@pytest.mark.heavy
def test_a_quantized_base_s_codes_and_scales_cross_each_layer_s_barrier():
    # transformers hands torch_xla's checkpoint a partial, not the layer's bound method, so
    # torch_xla would fence the hidden states only: the recomputed dequantization would then be
    # the forward's own expression, merged with it, and every layer's dequantized weights would
    # stay alive until the backward.
    plain, _ = lora_grads("llama", checkpointed=False, quantize="q8_0")
    checkpointed, hlo = lora_grads("llama", checkpointed=True, quantize="q8_0")
    for reference, ours in zip(plain, checkpointed, strict=True):
        assert_equal_in_exact_arithmetic(ours, reference, "checkpointed gradient")
    barriers = [line.split("opt-barrier(")[0] for line in hlo.splitlines() if "opt-barrier(" in line]
    # A layer's barrier holds its hidden states [2, 16, 32] and its 7 Linears' codes (s8) and
    # scales (f16); each matmul's own backward barrier holds one Linear's.
    layer_barriers = [b for b in barriers if "f64[2,16,32]" in b and b.count("s8[") == 7 and b.count("f16[") >= 7]
    assert len(layer_barriers) == 2, barriers
