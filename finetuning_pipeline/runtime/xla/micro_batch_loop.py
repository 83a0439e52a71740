"""Gradient accumulation as one XLA While loop: one micro-batch traced and compiled, run k times.

Traced as a Python loop, k micro-batches put k copies of forward and backward into the step's
graph: tracing and compile time grow with k (a 32-layer model: 12 s to compile at k=1, 248 s
at k=8, `make bench-host`). Here the micro-batch's work is traced once, on the first
micro-batch, lowered to an XLA computation, and called from a While loop that slices the
stacked micro-batches and sums the results; the compiler sees one micro-batch whatever k is.
torch_xla's `gradient_accumulation` and `scan` build their loops the same way; this one takes
the torch_xla RNG seed of each micro-batch as data (for random draws such as attention
dropout; LoRA dropout takes its seed from the micro-batch itself, lora_logic/dropout.py), so
the traced Python loop given the same seeds draws the same numbers (step.py's reference path)."""

from __future__ import annotations

from typing import Callable

import torch

from finetuning_pipeline.runtime.xla.step_capture import data_id, lower


def summed_over_micro_batches(body: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]],
                              micro_batches: list[dict[str, torch.Tensor]], seeds: torch.Tensor,
                              reads: list[torch.Tensor]) -> list[torch.Tensor]:
    """sum(body(batch) for batch in micro_batches), element-wise over body's list of tensors,
    with torch_xla's RNG seeded with seeds[i] (an int64 device tensor [k]) for micro-batch i.

    reads: the materialised tensors body reads that may change between steps (the weights);
    they enter the loop as themselves, so a step captured around the loop (step_capture.py)
    sees them as the state they are. Anything else body reads enters as its current data.
    body must not update anything in place (the loop would not see it)."""
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model as xm
    from torch_xla.experimental.scan import dynamic_slice

    keys = sorted(micro_batches[0])
    first = [micro_batches[0][k] for k in keys]
    if any(torch_xla._XLAC._check_tensor_need_materialization(reads + first)):
        raise RuntimeError("summed_over_micro_batches: the weights or the first micro-batch are not materialised; "
                           "call torch_xla.sync() first")
    by_data = {}
    for t in reads:
        by_data.setdefault(data_id(t), t)
    stacked = [torch.stack([batch[k] for batch in micro_batches]) for k in keys]  # [k, ...] each
    # The body is traced on the first micro-batch itself (real tensors: a placeholder tensor
    # has no SPMD sharding, and a computation with one crashes under SPMD); in the loop its
    # parameters take each micro-batch's slice instead.
    xm.set_rng_state(0)  # the seed's data is a parameter too: seeds[i] in the loop
    outputs = body(dict(zip(keys, first)))
    computation, parameters = lower(outputs, "micro_batch", reads + first)
    # The computation's parameters: the micro-batch's, the seed, and everything else it read
    # (loop-invariant), the weights as themselves (CapturedStep binds them to the state they are).
    batch_params = [next((p for p, data, _ in parameters if data == data_id(t)), -1) for t in first]  # -1: unread
    seed_params = [p for p, data, _ in parameters if data == torch_xla._XLAC._get_seed_info_id()]
    invariant = {p: by_data.get(data, value) for p, data, value in parameters
                 if p not in batch_params and p not in seed_params}

    device = stacked[0].device
    accumulators = [torch.zeros(t.shape, dtype=t.dtype, device=device) for t in outputs]
    loop_inputs = ([torch.tensor(0, dtype=torch.int64, device=device)] + accumulators + stacked
                   + [seeds.to(torch.int64)] + list(invariant.values()))
    builder = xb.create_builder("micro_batch_loop")
    params = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(loop_inputs)]
    count, n_acc, n_batch = len(micro_batches), len(accumulators), len(stacked)

    def condition(i, *_):
        return i < xb.Op.scalar(i.builder(), count, dtype=xb.Type.S64)

    def step(i, *rest):
        acc, batches = list(rest[:n_acc]), rest[n_acc:n_acc + n_batch]
        seeds_op, invariant_ops = rest[n_acc + n_batch], rest[n_acc + n_batch + 1:]
        arguments = [None] * len(parameters)
        for param, batch in zip(batch_params, batches):
            if param != -1:
                arguments[param] = dynamic_slice(batch, i)
        for param, value in zip(invariant, invariant_ops):
            arguments[param] = value
        for param in seed_params:
            arguments[param] = dynamic_slice(seeds_op, i)
        result = xb.Op.call(computation, arguments)
        acc = [a + result.get_tuple_element(j) for j, a in enumerate(acc)]
        one = xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S64)
        return (i + one, *acc, *batches, seeds_op, *invariant_ops)

    loop = xb.Op.mkwhile(params, condition, step).build("micro_batch_loop")
    results = torch_xla._XLAC._xla_user_computation("xla::micro_batch_loop", loop_inputs, loop)
    return results[1:1 + n_acc]
