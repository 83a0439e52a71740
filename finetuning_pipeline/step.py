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
from finetuning_pipeline.collectives import Collectives


def block_causal_mask(position_ids: torch.Tensor, dtype: torch.dtype, sdpa: bool) -> torch.Tensor:
    """[B, 1, L, L] mask letting each token see earlier tokens of its own packed segment only.

    Segments start where position_ids == 0 (how `dataset.packing` lays out blocks). Passing a
    4D mask also keeps transformers from inspecting position_ids for packing itself, which
    branches in Python on a tensor (a host sync per forward on XLA, and a graph that depends
    on the data). sdpa takes a boolean mask (True = attend); eager attention adds a float one.
    """
    segment = torch.cumsum((position_ids == 0).to(torch.int32), dim=-1)  # [B, L]
    same_segment = segment[:, :, None] == segment[:, None, :]  # [B, L, L]
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (same_segment & causal)[:, None]  # [B, 1, L, L]
    if sdpa:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_mask(length: int, device, dtype: torch.dtype, sdpa: bool) -> torch.Tensor:
    """[1, 1, L, L] plain causal mask, broadcast over the batch (same conventions as above)."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if sdpa:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_lm_loss_sum(model, batch: dict[str, torch.Tensor], packed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of next-token losses over label tokens, number of label tokens), fp32, on device.

    packed: the block holds separate samples (phase 2): positions restart per sample and a
    block-diagonal mask keeps them apart. Otherwise (phase 1: one stream of text, positions
    0..L-1) a plain causal mask is exact, and cheaper: one [1, 1, L, L] mask instead of a
    per-sequence [B, 1, L, L] one (12% of a step on the benchmark's large model). Either way
    the mask is explicit: without one, transformers derives positions and probes them for
    packing with a Python branch on a tensor, a host sync every forward.
    """
    input_ids = batch["input_ids"].long()
    labels = batch["labels"].long()
    sdpa = getattr(model.config, "_attn_implementation", "sdpa") == "sdpa"
    if packed:
        position_ids = batch["position_ids"].long()
        mask = block_causal_mask(position_ids, model.dtype, sdpa)
        logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=False).logits
    else:
        mask = causal_mask(input_ids.shape[1], input_ids.device, model.dtype, sdpa)
        logits = model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
    # Token t predicts token t+1: logits [B, L-1, V] against labels [B, L-1].
    shifted_logits = logits[:, :-1].float()
    shifted_labels = labels[:, 1:]
    loss_sum = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]),
        shifted_labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    count = (shifted_labels != IGNORE_INDEX).sum().to(torch.float32)
    return loss_sum, count


def train_step(model, optimizer, micro_batches, *, max_grad_norm: float, collectives: Collectives | None = None,
               packed: bool = True) -> dict[str, torch.Tensor]:
    """Accumulate gradients over `micro_batches`, average, clip, step. Returns device tensors:
    loss (mean per label token), tokens (label tokens in the step), grad_norm (before
    clipping) and applied (False when the loss or the gradient norm was not finite: the
    optimizer then skipped the update, on the device). The caller marks the step boundary."""
    device = optimizer.params[0].device
    loss_total = torch.zeros((), device=device)
    tokens = torch.zeros((), device=device)
    for batch in micro_batches:
        loss_sum, count = causal_lm_loss_sum(model, batch, packed)
        loss_sum.backward()
        loss_total = loss_total + loss_sum.detach()
        tokens = tokens + count
    grad = optimizer.flat_grad()  # one vector: clipping and the update are a few operations on it
    if collectives is not None:  # sums over the replicas (one collective for all three)
        grad, loss_total, tokens = collectives.sum_device([grad, loss_total, tokens])
    # Average and clip in one multiplication: norm(scale * g) = scale * norm(g), and the clip
    # coefficient is torch.nn.utils.clip_grad_norm_'s: max_norm / (norm + 1e-6), at most 1.
    scale = (1.0 / torch.clamp(tokens, min=1.0)).reshape(())  # no label tokens: grads stay 0
    grad_norm = torch.linalg.vector_norm(grad) * scale
    coefficient = scale
    if max_grad_norm > 0:
        coefficient = scale * torch.clamp(max_grad_norm / (grad_norm + 1e-6), max=1.0)
    loss = loss_total * scale
    applied = torch.isfinite(loss) & torch.isfinite(grad_norm)
    optimizer.step(applied, grad=grad * coefficient)
    optimizer.zero_grad()  # None: every step starts without gradients, so every step is one graph
    return {"loss": loss, "tokens": tokens, "grad_norm": grad_norm, "applied": applied}


@torch.no_grad()
def eval_sums(model, batch: dict[str, torch.Tensor], packed: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    return causal_lm_loss_sum(model, batch, packed)
