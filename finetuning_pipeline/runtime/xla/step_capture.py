"""Trace the training step once; replay its compiled graph at every later step.

Lazy tensors cost host time per traced operation, every step: on a 32-layer model the host
spent more time tracing forward, backward and update than a TPU spends running them. The
graph is the same every step (fixed shapes, no Python branch on a tensor), so it is traced
once: `CapturedStep` runs the step function on the lazy tensors, lowers what it computed to
one XLA computation, and from then on only binds the current tensors to that computation's
parameters and hands it to torch_xla as a single operation (torch_xla's own `scan` and
`gradient_accumulation` build their loops from the same pieces). A replayed step is one
graph of a few nodes: a 32-layer model's step is bound and launched in 14 ms where tracing
it took 197 ms (`make bench-host`).

Contract of the step function: `step_fn(inputs) -> dict of result tensors`, where `inputs` is any
nesting of lists, tuples and dicts of tensors (torch's pytree: the micro-batches as they are),
the same structure at every step. It may read and
update in place (`copy_`, `add_`) the tensors `state()` lists, and read anything else that
does not change between steps (frozen weights, buffers, constants it makes). Every tensor it
updates must be in `state()`: an update of another tensor would be traced once and never
again. It draws no torch random numbers of its own (they would repeat at every replay: the
capture refuses them); the micro-batch loop takes a seed per micro-batch as data
(micro_batch_loop.py), and LoRA dropout a seed tensor (lora_logic/dropout.py).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


class CapturedStep:
    """`step = CapturedStep(step_fn, state)`, then `results = step(inputs)` every step.

    The first call traces `step_fn` on its inputs (or `capture(examples)` does, earlier), keeps
    the lowered computation and puts the state back as it was; every call then replays it.
    Inputs keep their shapes and dtypes from call to call (a different shape is a different
    computation: an error, not a silent retrace).
    """

    def __init__(self, step_fn: Callable[[Any], dict], state: Callable[[], list[torch.Tensor]],
                 name: str = "train_step") -> None:
        self.step_fn = step_fn
        self.state = state
        self.name = name
        self.computation = None
        self.bindings: list[tuple[str, object]] = []  # per computation parameter: where its value comes from
        self.updated: list[int] = []  # indexes into state() of the tensors the step writes
        self.result_keys: list[str] = []
        self.signature: list[tuple] = []
        self.structure = None  # the inputs' pytree structure (their tensors are the graph's inputs, in order)
        self.result_signature: dict[str, tuple] = {}

    @property
    def captured(self) -> bool:
        return self.computation is not None

    def __call__(self, inputs) -> dict:
        flat, structure = tree_flatten(inputs)
        signature = [(tuple(t.shape), t.dtype) for t in flat]
        if self.computation is None:
            self.capture(inputs)
        elif structure != self.structure:
            raise ValueError(f"{self.name}: inputs changed from {self.structure} to {structure}; a captured step "
                             "replays one structure of inputs")
        elif signature != self.signature:
            raise ValueError(f"{self.name}: inputs changed from {self.signature} to {signature}; a captured step "
                             "replays one shape")
        return self._replay(flat)

    def capture(self, examples) -> dict[str, tuple]:
        """Trace the step on `examples`: materialised tensors of the inputs' shapes, dtypes and
        SPMD shardings (the first inputs themselves, or zeros). Returns the results' (shape,
        dtype)s. Call it when nothing is pending on the device (right after a
        `torch_xla.sync()`): whatever is still pending then is dropped with the trace's leftovers.

        Real tensors, not torch_xla's placeholder tensors: a placeholder carries no sharding,
        and under SPMD the computation then crashes the process (torch_xla 2.9, XLA:CPU)."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        # Wait, once, for the device: the trace's leftovers are dropped below, and a tensor whose
        # data an in-flight execution has yet to fill would lose it (torch_xla's
        # gradient_accumulation waits here too).
        xm.wait_device_ops()
        examples, structure = tree_flatten(examples)
        state = self.state()
        if any(torch_xla._XLAC._check_tensor_need_materialization(state + examples)):
            raise RuntimeError(f"{self.name}: state or example tensors are not materialised; "
                               "call torch_xla.sync() before the first step")
        # Each graph parameter is a device data node that names the tensor whose data it holds.
        # Small 0-dim tensors of equal value can share one data (torch_xla caches them), so the
        # owners of a data are collected; a shared one the step updates is refused below.
        owners: dict[int, list[tuple[str, int]]] = {}
        for kind, tensors in (("input", examples), ("state", state)):
            for i, t in enumerate(tensors):
                owners.setdefault(data_id(t), []).append((kind, i))

        results = self.step_fn(tree_unflatten(list(examples), structure))
        self.result_keys = list(results)
        self.result_signature = {k: (tuple(v.shape), v.dtype) for k, v in results.items()}
        self.updated = [i for i, flag in enumerate(torch_xla._XLAC._check_tensor_need_materialization(state)) if flag]
        if any(torch_xla._XLAC._check_tensor_need_materialization(examples)):
            raise RuntimeError(f"{self.name}: the step updates one of its inputs in place; return the new value")
        outputs = [state[i] for i in self.updated] + [results[k] for k in self.result_keys]
        updated = {("state", i) for i in self.updated}
        # What the step only reads is listed as uncloned; the updated state's data is given back below.
        kept = list(examples) + [t for i, t in enumerate(state) if ("state", i) not in updated]
        self.computation, parameters = lower(outputs, f"captured_{self.name}", kept)

        bindings: dict[int, tuple[str, object]] = {}
        originals: dict[int, torch.Tensor] = {}
        for param, data, value in parameters:
            found = owners.get(data)
            if data == torch_xla._XLAC._get_seed_info_id():
                raise RuntimeError(f"{self.name}: the step draws torch random numbers outside the micro-batch loop; "
                                   "a replay would repeat them (seed them by data, as lora_logic/dropout.py does)")
            if found is None:
                bindings[param] = ("constant", value)  # made by the step itself: the same every step
            elif sum(kind == "input" for kind, _ in found) > 1:
                raise RuntimeError(f"{self.name}: inputs {found} share one device data, so the replay could not tell "
                                   "them apart; capture on distinct tensors ([1]-shaped, not 0-dim)")
            elif len(found) > 1 and updated.intersection(found):
                raise RuntimeError(f"{self.name}: tensors {found} share one device data and the step updates "
                                   "one of them; make each its own tensor ([1]-shaped, not 0-dim)")
            else:
                bindings[param] = found[0]
                if found[0] in updated:
                    originals[found[0][1]] = value  # its data before the step
        self.bindings = [bindings[i] for i in range(len(bindings))]
        self.signature = [(tuple(t.shape), t.dtype) for t in examples]
        self.structure = structure
        # The trace changed the state tensors lazily: put their data back (the replay computes the
        # step), then drop whatever else the trace left pending (views, autograd buffers), as
        # torch_xla's dynamo bridge does after its own tracing run. (A swap, not copy_: under
        # SPMD a copy_ is pending IR, which the drop would take away with the data.)
        for i, data in originals.items():
            torch_xla._XLAC._replace_xla_tensor(state[i], data)
        torch_xla._XLAC._clear_pending_irs(str(examples[0].device))
        return self.result_signature

    def _replay(self, inputs: list[torch.Tensor]) -> dict:
        """inputs: the tensors of the step's inputs, flattened."""
        import torch_xla

        state = self.state()
        sources = {"state": state, "input": inputs}
        arguments = [sources[kind][where] if kind in sources else where for kind, where in self.bindings]
        outputs = torch_xla._XLAC._xla_user_computation(f"xla::captured_{self.name}", arguments, self.computation)
        with torch.no_grad():  # copy_, not a swap: views of the state (detach()) see the new value too
            for i, value in zip(self.updated, outputs):
                state[i].copy_(value)
        return dict(zip(self.result_keys, outputs[len(self.updated):]))


def data_id(tensor: torch.Tensor) -> int:
    """The id torch_xla records with a materialised tensor's device data (that of the tensor
    that made it), without the side effect of swapping the data for a copy."""
    import torch_xla

    (found,), _ = torch_xla._XLAC._get_tensors_xla_device_data_node([tensor], [tensor])
    return found


def lower(outputs: list[torch.Tensor], name: str, uncloned: list[torch.Tensor]) -> tuple[object, list[tuple]]:
    """(XLA computation of `outputs`, [(parameter number, data id, data)] for each parameter).

    torch_xla's `_get_tensors_xla_device_data_node` swaps the data of every tensor it reports
    for a copy with a new id unless the tensor is in `uncloned`: list there what the caller
    will bind by identity. Each `xm.set_rng_state` in a trace makes another RNG seed node under
    the seed's id (torch_xla's activation checkpointing restores the RNG that way before
    recomputing a layer, with a value the host derived from the seed), and torch_xla reports
    such nodes once per id or once each: a computation with more than one seed, or with a
    parameter it did not report, is refused, naming the setting that avoids it. LoRA dropout
    draws no torch random numbers (lora_logic/dropout.py); the model's own dropout does."""
    import torch_xla
    import torch_xla.core.xla_builder as xb

    context = torch_xla._XLAC.lowering.LoweringContext(name)
    context.set_name_string(name)
    context.build(outputs)
    computation = xb.computation_from_module_proto(name, context.hlo())
    parameters = [(context.tensor_parameter_id(value), data, value)
                  for data, value in zip(*torch_xla._XLAC._get_tensors_xla_device_data_node(outputs, uncloned))]
    text = xb.get_computation_hlo(computation)
    entry = text[text.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    shapes = {int(n): shape for shape, n in re.findall(r"= (\S+) parameter\((\d+)\)", entry)}
    missing = [f"parameter {n}: {shapes[n]}" for n in sorted(set(shapes) - {p for p, _, _ in parameters})]
    seeds = [f"parameter {p}" for p, data, _ in parameters if data == torch_xla._XLAC._get_seed_info_id()]
    if missing or len(seeds) > 1:
        raise RuntimeError(f"a captured step has more than one RNG seed ({', '.join(missing + seeds)}): random "
                           "numbers drawn inside a checkpointed layer (the model's dropout with "
                           "model.activation_checkpointing?), whose restored seeds a replay cannot derive; set "
                           "train.capture_step=false")
    return computation, parameters
