"""The evaluation loop, shared by the trainer (every replica, on its runtime's device) and the
`evaluate` command (one process, CPU or XLA): mean next-token loss per label token over a
prepared split, and its perplexity. The loss is the trainer's (`step.eval_sums`), so the two
report the same figure for the same model and data.
"""

from __future__ import annotations

import math

import torch

from dataset.loader import iter_eval_batches
from finetuning_pipeline.distributed.collectives import Collectives
from finetuning_pipeline.model.causal_lm_loss import auto_chunk_tokens
from finetuning_pipeline.train.step import eval_sums
from utils.device_tensors import device_counter, to_host

NO_EVAL_DATA = {"loss": None, "perplexity": None, "label_tokens": 0}


def describe_eval(result: dict) -> str:
    """One line for a log: the loss and perplexity, or that there was nothing to evaluate."""
    if result["loss"] is None:
        return "no eval data (the eval split is empty, or eval.max_batches is 0)"
    return (
        f"loss {result['loss']:.4f}, perplexity {result['perplexity']:.2f} over {result['label_tokens']} label tokens"
    )


def evaluate_loss(model, data_dir: str, *, micro_batch: int, pad_id: int, packed: bool, device,
                  split: str = "eval", max_batches: int | None = None, loss_chunk: int | None = None,
                  collectives: Collectives | None = None, input_sharding=None, replicate=lambda tensors: None,
                  to_device=None, boundary=lambda: None) -> dict:
    """{"loss", "perplexity", "label_tokens"} over `split`, every block counted once across the
    replicas of `collectives` (each reads its share). A split without label tokens (an empty
    eval split, max_batches=0) has no loss: loss and perplexity are None, never a perfect 0. Every
    batch runs the same small graph (`boundary`, the runtime's step boundary, after each) and the
    totals are read once, at the end: one host sync per evaluation.
    to_device(batch, device, input_sharding): the runtime's (default: a plain copy).
    loss_chunk: tokens per loss chunk (None: the model's default, causal_lm_loss.auto_chunk_tokens).
    replicate: marks the running sums' sharding under SPMD (Parallel.replicate)."""
    collectives = collectives or Collectives()
    if max_batches == 0:
        return dict(NO_EVAL_DATA)
    if loss_chunk is None:
        loss_chunk = auto_chunk_tokens(model.config)
    to_device = to_device or (lambda batch, device, sharding: {k: t.to(device) for k, t in batch.items()})
    was_training = model.training
    model.eval()
    # data: every batch runs one graph; the loss's sum in the loss's dtype (float64 in the proofs)
    loss_sum = device_counter(0, device, torch.promote_types(model.dtype, torch.float32))
    count = device_counter(0, device)
    replicate([loss_sum, count])
    batches = iter_eval_batches(data_dir, micro_batch, pad_id=pad_id, split=split, rank=collectives.rank,
                                world_size=collectives.world)
    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            break
        batch = to_device(batch, device, input_sharding)
        batch_loss, batch_count = eval_sums(model, batch, packed, loss_chunk)
        loss_sum = loss_sum + batch_loss
        count = count + batch_count
        boundary()  # one small graph per batch, the same every time
    loss_sum, count = collectives.sum_device([loss_sum, count])
    boundary()
    total_loss, total_count = to_host(loss_sum, count)
    model.train(was_training)
    if total_count == 0:
        return dict(NO_EVAL_DATA)
    loss = total_loss / total_count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "label_tokens": int(total_count)}
