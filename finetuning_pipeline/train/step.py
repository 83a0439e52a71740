"""One optimizer step on the device: forwards, backwards, gradient averaging, clip, update.

Everything here stays on the device: no `.item()`, no Python branch on a tensor, and the same
shapes every step, so after warm-up each step replays one compiled graph.

Loss normalisation: each micro-batch returns the *sum* of token losses and the number of
label tokens; gradients are divided by the step's total label count (all micro-batches, all
replicas) before clipping. So k micro-batches of b sequences give exactly the gradient of one
batch of k*b (a mean of per-micro-batch means would weight short micro-batches more).

A preference phase (`objective`: model/preference_loss.py's PreferenceObjective) returns the sum
of its pairs' losses and its pair count instead, and the sums of its metrics besides: the same
arithmetic divides by the step's pairs, and the metric sums travel with the step's results
("metric_sums", summed over micro-batches and replicas like the loss).
"""

from __future__ import annotations

import contextlib

import torch

from finetuning_pipeline.distributed.collectives import Collectives
from finetuning_pipeline.model.causal_lm_loss import causal_lm_loss_sum
from lora_logic.dropout import set_dropout_seed
from utils.precision import float64_throughout


def micro_batch_gradients(model, optimizer, batch: dict[str, torch.Tensor], packed: bool = True,
                          loss_chunk: int = 0, objective=None) -> list[torch.Tensor]:
    """[flat LoRA gradient of the loss sum, loss sum, label tokens] of one micro-batch; leaves
    no `.grad` behind, so it can be traced once and looped (runtime/xla/micro_batch_loop.py).
    objective: a preference phase's (module docstring): [gradient, loss sum, pairs, metric sums].
    batch["lora_seed"] (int32 [1] or [rows, 1], optional): the seeds of its LoRA dropout masks
    (lora_logic/dropout.py; the trainer's: one per sequence, train/phase_data.py's lora_dropout_seeds).
    A model of K adapters side by side: loss sum and label tokens per adapter, [K]; the gradient
    of their total is each adapter's own, as its rows reach only its weights."""
    # The optimizer's groups are the model's adapters (one per adapter side by side): known, not
    # looked up in the model's modules at every trace.
    def loss_sums(b):
        if objective is not None:
            return objective(model, b, optimizer.group_count)
        return causal_lm_loss_sum(model, b, packed, loss_chunk, groups=optimizer.group_count)

    sums = micro_batch_backward(model, batch, loss_sums)
    grad = optimizer.flat_grad()
    optimizer.zero_grad()
    return [grad, *sums]


def micro_batch_backward(model, batch: dict[str, torch.Tensor], loss_sums) -> list[torch.Tensor]:
    """The backward of one micro-batch's loss sum, its gradients added to the `.grad`s: [loss sum,
    label tokens] (a preference objective's: [loss sum, pairs, metric sums]). loss_sums(batch):
    causal_lm_loss_sum of the model, or the objective's, or what computes it through a wrapper (the
    native runtime's DistributedDataParallel)."""
    set_dropout_seed(model, batch.get("lora_seed"))
    with float64_throughout(model.dtype):  # (the backward too: a checkpointed layer's forward runs again in it)
        loss_sum, *rest = loss_sums(batch)
        loss_sum.sum().backward()  # (a checkpointed layer recomputes its forward here, with the same masks)
    set_dropout_seed(model, None)
    return [loss_sum.detach(), *rest]


def train_step(model, optimizer, micro_batches, *, max_grad_norm: float, collectives: Collectives | None = None,
               packed: bool = True, loss_chunk: int = 0, seeds: list[int] | None = None,
               active: torch.Tensor | None = None, seed_rng=None, replicated=None,
               objective=None) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches`, average, clip, step. Returns device tensors:
    loss (mean per label token), tokens (label tokens in the step), grad_norm (before
    clipping) and applied (False when the loss or the gradient norm was not finite: the
    optimizer then skipped the update, on the device). The caller marks the step boundary.

    This is the native runtime's step, and the XLA runtime's traced every time (train.capture_step
    false: the reference its captured step, runtime/xla/step_execution.py, is tested against).
    seeds, seed_rng: seed_rng(seeds[i]) seeds the RNG the model's own dropout draws from before
    micro-batch i (the runtime's StepExecution.seed_rng); None leaves the RNG as it is.
    active: adapters side by side, which of them step (apply_update).
    replicated: the model's loss under DistributedDataParallel (runtime/native/ddp.py), which sums
    the LoRA gradients over the replicas in the backward of the step's last micro-batch, as that
    backward produces them: the micro-batches before it run under its no_sync(), their gradients
    adding up in the .grads, and the step reads the gradient once; `collectives` then sums the
    loss sums and label tokens only. The same sums as reading each micro-batch's gradient.
    objective: a preference phase's loss (the module's docstring); the results then hold its
    "metric_sums" too."""
    sums = None
    for i, batch in enumerate(micro_batches):
        if seeds is not None:
            seed_rng(seeds[i])
        if replicated is None:
            out = micro_batch_gradients(model, optimizer, batch, packed, loss_chunk, objective)
        else:
            with replicated.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                out = micro_batch_backward(model, batch, replicated)
        sums = out if sums is None else [a + b for a, b in zip(sums, out)]
    if replicated is not None:  # the gradient is already summed over the replicas
        grad = optimizer.flat_grad()
        optimizer.zero_grad()
        loss_total, tokens, *metrics = collectives.sum_device(sums)
    else:
        grad, loss_total, tokens, *metrics = sums
        if collectives is not None:  # sums over the replicas (one collective for them all)
            grad, loss_total, tokens, *metrics = collectives.sum_device([grad, loss_total, tokens, *metrics])
    results = apply_update(optimizer, grad, loss_total, tokens, max_grad_norm, active)
    return {**results, "metric_sums": metrics[0]} if metrics else results


def apply_update(optimizer, grad: torch.Tensor, loss_total: torch.Tensor, tokens: torch.Tensor,
                 max_grad_norm: float, active: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Average the summed gradient over the step's label tokens, clip, and update (train_step's results).
    Adapters side by side (`active` given: [G] bool, False leaves a group's adapter as it is:
    its steps are done, or it diverged): each of these per group of the optimizer, loss_total
    and tokens [G], and so are the results."""
    # Average and clip in one multiplication: norm(scale * g) = scale * norm(g), and the clip
    # coefficient is torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + 1e-6), at most 1.
    grouped = active is not None  # adapters side by side
    scale = 1.0 / torch.clamp(tokens, min=1.0)  # no label tokens: grads stay 0
    if not grouped:
        scale = scale.reshape(())
    grad_norm = optimizer.group_norms(grad) * scale
    coefficient = scale
    if max_grad_norm > 0:
        coefficient = scale * torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0)
    loss = loss_total * scale
    applied = torch.isfinite(loss) & torch.isfinite(grad_norm)
    results = {"loss": loss, "tokens": tokens, "grad_norm": grad_norm}
    if grouped:
        # A skipped update is a non-finite one (DivergenceMonitor); an adapter not stepping has none.
        results["skipped"] = ~applied & active
        applied = applied & active
        coefficient = optimizer.per_element(coefficient)
    optimizer.step(applied, grad=grad * coefficient)
    return {**results, "applied": applied}


@torch.no_grad()
def eval_sums(model, batch: dict[str, torch.Tensor], packed: bool = True,
              loss_chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    with float64_throughout(model.dtype):
        return causal_lm_loss_sum(model, batch, packed, loss_chunk)
