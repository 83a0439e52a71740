"""The evaluation loop, shared by the trainer (every replica, on its runtime's device) and the
`evaluate` command (one process, CPU or XLA): mean next-token loss per label token over a
prepared split, and its perplexity. The loss is the trainer's (`step.eval_sums`), so the two
report the same figure for the same model and data. A split of preference pairs: the mean of the
preference loss over its pairs and TRL's metrics (`evaluate_pairs`), the trainer's loss again.
"""

from __future__ import annotations

import math

import torch

from dataset.loader import iter_eval_batches
from finetuning_pipeline.distributed.collectives import Collectives
from finetuning_pipeline.model.causal_lm_loss import auto_chunk_tokens
from finetuning_pipeline.model.preference_loss import METRIC_SUMS, metrics_of, pair_rows, sequence_logps
from finetuning_pipeline.train.step import eval_sums
from utils.device_tensors import device_counter, to_host
from utils.precision import float64_throughout

NO_EVAL_DATA = {"loss": None, "perplexity": None, "label_tokens": 0}


def describe_eval(result: dict) -> str:
    """One line for a log: the loss and perplexity (of pairs: the reward margin and accuracy), or
    that there was nothing to evaluate."""
    if result["loss"] is None:
        return "no eval data (the eval split is empty, or eval.max_batches is 0)"
    if "pairs" in result:
        return (f"loss {result['loss']:.4f}, reward margin {result['rewards/margins']:.4f}, accuracy "
                f"{result['rewards/accuracies']:.2f} over {result['pairs']} pairs")
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
    if max_batches == 0:
        return dict(NO_EVAL_DATA)
    if loss_chunk is None:
        loss_chunk = auto_chunk_tokens(model.config)
    dtype = torch.promote_types(model.dtype, torch.float32)  # the loss's (float64 in the proofs)
    total_loss, total_count = summed_over_split(
        model, data_dir, lambda batch: eval_sums(model, batch, packed, loss_chunk), [(dtype, 1), (torch.float32, 1)],
        micro_batch=micro_batch, pad_id=pad_id, device=device, split=split, max_batches=max_batches,
        collectives=collectives, input_sharding=input_sharding, replicate=replicate, to_device=to_device,
        boundary=boundary)
    if total_count == 0:
        return dict(NO_EVAL_DATA)
    loss = total_loss / total_count
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "label_tokens": int(total_count)}


def evaluate_pairs(model, data_dir: str, objective, *, micro_batch: int, pad_id: int, device, split: str = "eval",
                   max_batches: int | None = None, collectives: Collectives | None = None, input_sharding=None,
                   replicate=lambda tensors: None, to_device=None, boundary=lambda: None,
                   references: list[torch.Tensor] | None = None) -> dict:
    """A split of preference pairs: {"loss" (the mean over its pairs of objective's loss, as the
    trainer takes it), "perplexity": None, "pairs", and TRL's metrics (preference_loss.METRIC_SUMS'
    names)}; the arguments as evaluate_loss's. references: each batch's reference log-probabilities,
    computed before (split_reference_logps), in place of the objective's reference forward."""
    if max_batches == 0:
        return dict(NO_EVAL_DATA)
    dtype = torch.promote_types(model.dtype, torch.float32)
    given = iter(references) if references is not None else None

    def batch_sums(batch):
        if given is not None:
            batch = {**batch, "reference_logps": next(given).to(device)}
        return evaluated(model, objective, batch)

    loss, pairs, sums = summed_over_split(
        model, data_dir, batch_sums, [(dtype, 1), (torch.float32, 1), (dtype, len(METRIC_SUMS))],
        micro_batch=micro_batch, pad_id=pad_id, device=device, split=split, max_batches=max_batches,
        collectives=collectives, input_sharding=input_sharding, replicate=replicate, to_device=to_device,
        boundary=boundary)
    if not pairs:
        return dict(NO_EVAL_DATA)
    # (label_tokens: the pairs, a mean's weight over adapters side by side, as a training record's)
    return {"loss": loss / pairs, "perplexity": None, "pairs": int(pairs), "label_tokens": int(pairs),
            **metrics_of(sums, pairs)}


@torch.no_grad()
def split_reference_logps(model, data_dir: str, *, micro_batch: int, pad_id: int, device, split: str = "eval",
                          to_device=None, boundary=lambda: None) -> list[torch.Tensor]:
    """Each eval batch's reference log-probabilities ([P, 2] on the host: each pair's chosen and
    rejected), under `model` as it is (the reference model: evaluate's --reference-adapter or base),
    in the batches' order evaluate_pairs takes them again."""
    to_device = to_device or (lambda batch, device, sharding: {k: t.to(device) for k, t in batch.items()})
    was_training = model.training
    model.eval()
    found = []
    for batch in iter_eval_batches(data_dir, micro_batch, pad_id=pad_id, split=split):
        batch = to_device(batch, device, None)
        with float64_throughout(model.dtype):
            found.append(torch.stack(sequence_logps(model, *pair_rows(batch))[0].chunk(2), dim=1))
        boundary()
    model.train(was_training)
    return [values.cpu() for values in found]


@torch.no_grad()
def evaluated(model, objective, batch: dict) -> list[torch.Tensor]:
    with float64_throughout(model.dtype):
        return list(objective(model, batch))


def summed_over_split(model, data_dir: str, batch_sums, sums: list[tuple[torch.dtype, int]], *, micro_batch: int,
                      pad_id: int, device, split: str, max_batches: int | None, collectives: Collectives | None,
                      input_sharding, replicate, to_device, boundary) -> list:
    """The host totals of batch_sums(batch) (device tensors of the (dtype, size) `sums` list) over
    the split's batches, every block once across the replicas, the model in eval mode meanwhile."""
    collectives = collectives or Collectives()
    to_device = to_device or (lambda batch, device, sharding: {k: t.to(device) for k, t in batch.items()})
    was_training = model.training
    model.eval()
    # data: every batch runs one graph
    totals = [device_counter(0, device, dtype) if size == 1 else torch.zeros(size, dtype=dtype).to(device)
              for dtype, size in sums]
    replicate(totals)
    batches = iter_eval_batches(data_dir, micro_batch, pad_id=pad_id, split=split, rank=collectives.rank,
                                world_size=collectives.world)
    for index, batch in enumerate(batches):
        if max_batches is not None and index >= max_batches:
            break
        batch = to_device(batch, device, input_sharding)
        totals = [total + value for total, value in zip(totals, batch_sums(batch), strict=True)]
        boundary()  # one small graph per batch, the same every time
    totals = collectives.sum_device(totals)
    boundary()
    model.train(was_training)
    return to_host(*totals)
