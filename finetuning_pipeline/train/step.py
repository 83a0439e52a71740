"""One optimizer step on the XLA device: forwards, backwards, gradient averaging, clip, update.

Everything here stays on the device: no `.item()`, no Python branch on a tensor, and the same
shapes every step, so after warm-up each step replays one compiled graph.

Loss normalisation: each micro-batch returns the *sum* of token losses and the number of
label tokens; gradients are divided by the step's total label count (all micro-batches, all
replicas) before clipping. So k micro-batches of b sequences give exactly the gradient of one
batch of k*b (a mean of per-micro-batch means would weight short micro-batches more).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dataset.encode import IGNORE_INDEX
from finetuning_pipeline.model.attention_masks import attention_masks
from finetuning_pipeline.model.chunked_loss import chunked_loss_sum
from finetuning_pipeline.model.kernel_attention import kernel_masks, segment_ids, uses_kernel
from finetuning_pipeline.run.collectives import Collectives
from lora_logic.dropout import set_dropout_seed
from lora_logic.side_by_side import adapter_names


def causal_lm_loss_sum(model, batch: dict[str, torch.Tensor], packed: bool = True,
                       loss_chunk: int = 0, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses over label tokens, number of label tokens), fp32, on device.
    groups > 1: the rows are that many equal groups, one per adapter trained side by side
    (lora_logic/side_by_side.py): both are [groups], each group's loss computed on its rows
    alone, as a run of that adapter alone computes it on its batch.

    packed: the block holds separate samples (phase 2): positions restart per sample and each
    sample attends to itself only. Otherwise (phase 1: one stream of text, positions 0..L-1)
    the masks are [1, 1, L, L], broadcast over the batch (cheaper than [B, 1, L, L]: 12% of a
    step on the benchmark's large model). Each layer type gets its own mask (attention_masks.py).
    loss_chunk: tokens per chunk of the output projection and loss (chunked_loss.py); 0 builds
    the full logits.
    """
    input_ids = batch["input_ids"].long()
    labels = batch["labels"].long()
    position_ids = batch["position_ids"].long() if packed else None
    if uses_kernel(model.config):  # Pallas attention: segment ids instead of [L, L] masks
        masks = kernel_masks(model.config, segment_ids(position_ids, *input_ids.shape, input_ids.device))
    else:
        masks = attention_masks(model.config, input_ids.shape[1], input_ids.device, model.dtype, position_ids)
    inputs = {"input_ids": input_ids, "attention_mask": masks, "use_cache": False}
    if packed:
        inputs["position_ids"] = position_ids
    trained = labels[:, 1:] != IGNORE_INDEX
    if groups == 1:
        count = trained.sum().to(torch.float32)
    else:
        count = trained.reshape(groups, -1).sum(-1).to(torch.float32)
    rows = input_ids.shape[0] // groups

    def each_group(tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor] if groups == 1 else [tensor[k * rows:(k + 1) * rows] for k in range(groups)]

    if loss_chunk:
        hidden = model.base_model(**inputs).last_hidden_state  # [B, L, H], after the final norm
        sums = [chunked_loss_sum(h, y, model.get_output_embeddings(), model.config, loss_chunk)
                for h, y in zip(each_group(hidden), each_group(labels))]
    else:
        logits = model(**inputs).logits
        # Token t predicts token t+1: logits [B, L-1, V] against labels [B, L-1].
        sums = [F.cross_entropy(x[:, :-1].float().reshape(-1, x.shape[-1]), y[:, 1:].reshape(-1),
                                ignore_index=IGNORE_INDEX, reduction="sum")
                for x, y in zip(each_group(logits), each_group(labels))]
    return (sums[0] if groups == 1 else torch.stack(sums)), count


def micro_batch_gradients(model, optimizer, batch: dict[str, torch.Tensor], packed: bool = True,
                          loss_chunk: int = 0) -> list[torch.Tensor]:
    """[flat LoRA gradient of the loss sum, loss sum, label tokens] of one micro-batch; leaves
    no `.grad` behind, so it can be traced once and looped (micro_batch_loop.py).
    batch["lora_seed"] (int32 [1], optional): the seed of its LoRA dropout masks (lora_logic/dropout.py).
    A model of K adapters side by side: loss sum and label tokens per adapter, [K]; the gradient
    of their total is each adapter's own, as its rows reach only its weights."""
    set_dropout_seed(model, batch.get("lora_seed"))
    loss_sum, count = causal_lm_loss_sum(model, batch, packed, loss_chunk, groups=len(adapter_names(model)) or 1)
    loss_sum.sum().backward()  # (a checkpointed layer recomputes its forward here, with the same masks)
    set_dropout_seed(model, None)
    grad = optimizer.flat_grad()
    optimizer.zero_grad()
    return [grad, loss_sum.detach(), count]


def train_step(model, optimizer, micro_batches, *, max_grad_norm: float, collectives: Collectives | None = None,
               packed: bool = True, loss_chunk: int = 0, seeds: list[int] | None = None,
               active: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches`, average, clip, step. Returns device tensors:
    loss (mean per label token), tokens (label tokens in the step), grad_norm (before
    clipping) and applied (False when the loss or the gradient norm was not finite: the
    optimizer then skipped the update, on the device). The caller marks the step boundary.

    This is the step traced every time (train.capture_step false, and the reference the
    captured step is tested against: trainer.Stepper runs the same parts traced once).
    seeds: the torch_xla RNG seed of each micro-batch; None leaves the RNG as it is.
    active: adapters side by side, which of them step (apply_update)."""
    import torch_xla.core.xla_model as xm

    sums = None
    for i, batch in enumerate(micro_batches):
        if seeds is not None:
            xm.set_rng_state(seeds[i], device=optimizer.params[0].device)
        out = micro_batch_gradients(model, optimizer, batch, packed, loss_chunk)
        sums = out if sums is None else [a + b for a, b in zip(sums, out)]
    grad, loss_total, tokens = sums
    if collectives is not None:  # sums over the replicas (one collective for all three)
        grad, loss_total, tokens = collectives.sum_device([grad, loss_total, tokens])
    return apply_update(optimizer, grad, loss_total, tokens, max_grad_norm, active)


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
    grad_norm = (optimizer.group_norms(grad) if grouped else torch.linalg.vector_norm(grad)) * scale
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
    return causal_lm_loss_sum(model, batch, packed, loss_chunk)
