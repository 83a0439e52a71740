"""Activation checkpointing on XLA: the same gradients, and a real recompute in the graph."""

from __future__ import annotations

import pytest
import torch
import torch_xla
from conftest import ARCHITECTURES, random_tokens, tiny_causal_lm

from finetuning_pipeline.model.activation_checkpointing import enable_activation_checkpointing
from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum
from lora_logic.adapters import lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


def lora_grads(arch: str, checkpointed: bool) -> tuple[list[torch.Tensor], str]:
    model = tiny_causal_lm(arch)
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
    loss, _ = causal_lm_loss_sum(model, {"input_ids": tokens, "labels": tokens}, packed=False)
    loss.backward()
    grads = [p.grad for p in lora_parameters(model)]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    torch_xla.sync()  # one graph; .cpu() of each pending tensor would compile one per tensor
    return [g.cpu() for g in grads], hlo


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_checkpointing_gives_the_same_gradients(arch):
    plain, plain_hlo = lora_grads(arch, checkpointed=False)
    checkpointed, hlo = lora_grads(arch, checkpointed=True)
    assert len(plain) == len(checkpointed) == 2 * 7 * 2
    for reference, ours in zip(plain, checkpointed):
        assert reference.abs().max() > 0
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6)
    # torch_xla's checkpoint fences the recomputed inputs so XLA cannot merge the recompute
    # back into the forward (torch.utils.checkpoint would be silently undone).
    assert "opt-barrier" in hlo and "opt-barrier" not in plain_hlo
