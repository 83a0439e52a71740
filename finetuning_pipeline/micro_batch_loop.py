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

from finetuning_pipeline.step_capture import check_all_parameters_bound


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

    keys = sorted(micro_batches[0])
    first = [micro_batches[0][k] for k in keys]
    if any(torch_xla._XLAC._check_tensor_need_materialization(reads + first)):
        raise RuntimeError("summed_over_micro_batches: the weights or the first micro-batch are not materialised; "
                           "call torch_xla.sync() first")
    by_data = {}
    for t in reads:
        (data_id,), _ = torch_xla._XLAC._get_tensors_xla_device_data_node([t], [t])
        by_data.setdefault(data_id, t)
    stacked = [torch.stack([batch[k] for batch in micro_batches]) for k in keys]  # [k, ...] each
    # The body is traced on the first micro-batch itself (real tensors: a placeholder tensor
    # has no SPMD sharding, and a computation with one crashes under SPMD); in the loop its
    # parameters take each micro-batch's slice instead.
    xm.set_rng_state(0)  # the seed's data is a parameter too: seeds[i] in the loop
    outputs = body(dict(zip(keys, first)))
    context = torch_xla._XLAC.lowering.LoweringContext("MicroBatch")
    context.set_name_string("micro_batch")
    context.build(outputs)
    computation = xb.computation_from_module_proto("micro_batch", context.hlo())

    # The computation's parameters: the micro-batch's, then everything else it read (hoisted),
    # each found with the data it holds (its owner's data: CapturedStep binds it to that owner).
    # (What it reads is listed as uncloned: otherwise the call swaps its data for copies, new ids and all.)
    batch_params = [context.tensor_parameter_id(t) for t in first]  # -1: a key the body does not read
    hoisted, seed_param = {}, None
    for data_id, value in zip(*torch_xla._XLAC._get_tensors_xla_device_data_node(outputs, reads + first)):
        param = context.tensor_parameter_id(value)
        if data_id == torch_xla._XLAC._get_seed_info_id():
            seed_param = param
        elif param not in batch_params:
            hoisted[param] = by_data.get(data_id, value)
    seed_params = [seed_param] if seed_param is not None else []
    check_all_parameters_bound(computation, (set(batch_params) | set(hoisted) | set(seed_params)) - {-1})

    device = stacked[0].device
    accumulators = [torch.zeros(t.shape, dtype=t.dtype, device=device) for t in outputs]
    loop_inputs = ([torch.tensor(0, dtype=torch.int64, device=device)] + accumulators + stacked
                   + [seeds.to(torch.int64)] + list(hoisted.values()))
    builder = xb.create_builder("micro_batch_loop")
    params = [xb.mkparam(builder, i, xb.tensor_shape(t)) for i, t in enumerate(loop_inputs)]
    count, n_acc, n_batch = len(micro_batches), len(accumulators), len(stacked)
    hoisted_ids = list(hoisted)

    def condition(i, *_):
        return i < xb.Op.scalar(i.builder(), count, dtype=xb.Type.S64)

    def step(i, *rest):
        acc, batches = list(rest[:n_acc]), rest[n_acc:n_acc + n_batch]
        seeds_op, invariant = rest[n_acc + n_batch], rest[n_acc + n_batch + 1:]
        arguments = [None] * (len(set(batch_params) - {-1}) + len(hoisted) + len(seed_params))
        for param, batch in zip(batch_params, batches):
            if param != -1:
                arguments[param] = _slice(batch, i)
        for param, value in zip(hoisted_ids, invariant):
            arguments[param] = value
        for param in seed_params:
            arguments[param] = _slice(seeds_op, i)
        result = xb.Op.call(computation, arguments)
        acc = [a + result.get_tuple_element(j) for j, a in enumerate(acc)]
        one = xb.Op.scalar(i.builder(), 1, dtype=xb.Type.S64)
        return (i + one, *acc, *batches, seeds_op, *invariant)

    loop = xb.Op.mkwhile(params, condition, step).build("micro_batch_loop")
    results = torch_xla._XLAC._xla_user_computation("xla::micro_batch_loop", loop_inputs, loop)
    return results[1:1 + n_acc]


def _slice(stacked, i):
    """stacked[i] of an XLA builder op: [k, ...] -> [...]."""
    sizes = list(stacked.shape().sizes)
    start = [i] + [i.zeros_like() for _ in sizes[1:]]
    return stacked.dynamic_slice(start, [1] + sizes[1:]).reshape(sizes[1:])
