"""The traced step (step.train_step): gradient accumulation over micro-batches."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_causal_lm
from tolerances import assert_equal_in_exact_arithmetic

from finetuning_pipeline.train.step import train_step
from lora_logic.adapters import lora_modules, lora_parameters
from lora_logic.config import LoraConfig
from lora_logic.inject import inject_lora


class RecordGradients:
    """Stands in for the optimizer: keeps the gradients train_step hands it (averaged, clipped)."""

    group_count = 1  # one adapter

    def __init__(self, params):
        self.params = params
        self.grads = None
        self.applied = None

    def flat_grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def group_norms(self, flat):
        return torch.linalg.vector_norm(flat)

    def step(self, applied, grad):
        self.grads = [chunk.view(p.shape) for chunk, p in zip(torch.split(grad, [p.numel() for p in self.params]),
                                                              self.params)]
        self.applied = applied

    def zero_grad(self):
        for p in self.params:
            p.grad.zero_()


@pytest.mark.heavy
def test_gradient_accumulation_equals_one_large_batch():
    """2 micro-batches of 2 give the same gradient as 1 batch of 4, on the XLA device: equal in
    exact arithmetic, summed in other orders, so in float64 (tests/tolerances.py)."""
    import torch_xla

    from finetuning_pipeline.runtime.xla.device import init_xla_device

    device = init_xla_device()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=generator, dtype=torch.int32)
    labels = ids.clone()
    labels[0, :12] = -100  # unequal label counts per micro-batch: a mean of means would differ
    labels[3, :3] = -100
    positions = torch.arange(16, dtype=torch.int32).repeat(4, 1)
    full = {"input_ids": ids, "labels": labels, "position_ids": positions}

    def one_step(micro_batches):
        model = tiny_causal_lm("mistral").to(torch.float64)
        inject_lora(model, LoraConfig(r=4, alpha=8))
        with torch.no_grad():
            for _, m in lora_modules(model):
                m.lora_B["default"].weight.normal_(generator=torch.Generator().manual_seed(1))
        model.to(device).train()
        params = lora_parameters(model)
        recorder = RecordGradients(params)
        moved = [{k: v.to(device) for k, v in b.items()} for b in micro_batches]
        results = train_step(model, recorder, moved, max_grad_norm=0.0)
        torch_xla.sync()
        return [g.cpu() for g in recorder.grads], {k: v.cpu() for k, v in results.items()}

    split = [{k: v[:2] for k, v in full.items()}, {k: v[2:] for k, v in full.items()}]
    grads_a, results_a = one_step(split)
    grads_b, results_b = one_step([full])
    assert any(g.abs().max() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert a.dtype == torch.float64
        assert_equal_in_exact_arithmetic(a, b, "gradient")
    assert_equal_in_exact_arithmetic(results_a["loss"], results_b["loss"], "loss")
    assert_equal_in_exact_arithmetic(results_a["grad_norm"], results_b["grad_norm"], "gradient norm")
    assert results_a["tokens"].item() == results_b["tokens"].item() == (labels[:, 1:] != -100).sum().item()
    assert bool(results_a["applied"]) and bool(results_b["applied"])
