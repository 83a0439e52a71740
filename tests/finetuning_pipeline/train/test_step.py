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


def test_preference_pairs_accumulate_to_the_gradient_of_the_mean_over_every_pair():
    """A preference objective: 2 micro-batches of 2 pairs give the gradient and loss of their 4
    pairs' mean loss (autograd of it, the reference a frozen copy of the adapter's first weights),
    and the step's metric sums are those of the 4 pairs; on the CPU, in float64."""
    from finetuning_pipeline.model.preference_loss import (
        PreferenceObjective,
        PreferenceSettings,
        preference_loss_sum,
    )
    from utils.precision import float64_throughout

    generator = torch.Generator().manual_seed(0)
    pairs = {}
    for side in ("chosen", "rejected"):
        ids = torch.randint(0, 128, (4, 16), generator=generator, dtype=torch.int32)
        labels = ids.clone()
        labels[:, :5] = -100  # the prompt
        labels[1, 12:] = -100 if side == "chosen" else labels[1, 12:]  # completions of other lengths
        pairs[f"{side}_input_ids"], pairs[f"{side}_labels"] = ids, labels

    def model_and_objective():
        model = tiny_causal_lm("llama").to(torch.float64)
        inject_lora(model, LoraConfig(r=4, alpha=8))
        for _, m in lora_modules(model):
            m.add_frozen_copy("default", "reference")  # the reference: B = 0, the base, as a fresh adapter
            with torch.no_grad():
                m.lora_B["default"].weight.normal_(std=0.1, generator=generator)
        return model.train(), PreferenceObjective(PreferenceSettings("sigmoid", 0.5), "reference")

    torch.manual_seed(1)
    model, objective = model_and_objective()
    params = lora_parameters(model)
    recorder = RecordGradients(params)
    split = [{k: v[:2] for k, v in pairs.items()}, {k: v[2:] for k, v in pairs.items()}]
    results = train_step(model, recorder, split, max_grad_norm=0.0, objective=objective)

    with float64_throughout(model.dtype):  # as the step computes (transformers' fp32 islands kept float64)
        loss_sum, count, sums = preference_loss_sum(model, pairs, objective.settings, "reference")
        expected = torch.autograd.grad(loss_sum / count, params)
    assert count.item() == 4 and results["tokens"].item() == 4
    assert_equal_in_exact_arithmetic(results["loss"], loss_sum.detach() / count, "loss")
    assert_equal_in_exact_arithmetic(results["metric_sums"], sums, "metric sums")
    assert any(g.abs().max() > 0 for g in expected)
    for ours, theirs in zip(recorder.grads, expected, strict=True):
        assert_equal_in_exact_arithmetic(ours, theirs, "gradient")
