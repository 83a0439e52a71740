"""How the XLA runtime runs an optimizer step (runtime/protocol.py's StepExecution).

With train.capture_step (the default) the step is two captured graphs (step_capture.py), each
traced once, at the first step, and replayed after: the gradients of every micro-batch (one XLA
loop: micro_batch_loop.py) and the update; the sums over replicas sit between the two, as they
need a host round trip under torchrun on a CPU. Otherwise train/step.py's train_step traces
everything every step (the reference the captured step is tested against).
"""

from __future__ import annotations

import functools

import torch

from finetuning_pipeline.run_config import TrainConfig
from finetuning_pipeline.runtime.xla.micro_batch_loop import summed_over_micro_batches
from finetuning_pipeline.runtime.xla.scan_choice import model_dropouts
from finetuning_pipeline.runtime.xla.step_capture import CapturedStep
from finetuning_pipeline.train.adamw import MaskedAdamW
from finetuning_pipeline.train.step import apply_update, micro_batch_gradients, train_step


class XlaStepExecution:
    def __init__(self, model, optimizer: MaskedAdamW, *, train: TrainConfig, parallel, device, packed: bool,
                 loss_chunk: int, activation_checkpointing: bool, objective=None) -> None:
        t = train
        self.model, self.optimizer, self.parallel, self.device = model, optimizer, parallel, device
        self.packed, self.loss_chunk, self.max_grad_norm = packed, loss_chunk, t.max_grad_norm
        self.objective = objective  # a preference phase's loss (train/step.py), or None
        self.sums = SUMS + (("metric_sums",) if objective is not None else ())
        self.gradients = self.update = None
        self.note = None
        dropouts = model_dropouts(model.config) if activation_checkpointing else {}
        if t.capture_step and dropouts:
            # torch random numbers in a recomputed layer cannot be replayed (step_capture.lower refuses them)
            named = ", ".join(f"{name} {p}" for name, p in dropouts.items())
            self.note = (f"the step is traced every time: dropout in the model ({named}) with activation "
                         "checkpointing draws random numbers the captured step cannot replay")
        elif t.capture_step:
            # The traced functions are bound to the pieces they read, not to this object: a
            # CapturedStep holding its owner's own methods would be a reference cycle that kept
            # the phase's model and optimizer alive after it (until a garbage collection happened
            # to run), while the next phase loads its own.
            self.gradients = CapturedStep(
                functools.partial(gradient_sums, model, optimizer, packed, loss_chunk, objective),
                functools.partial(model_state, model), name="gradients")
            self.update = CapturedStep(functools.partial(update_from_sums, optimizer, self.max_grad_norm),
                                       functools.partial(optimizer_state, optimizer), name="update")

    def seed_rng(self, seed: int) -> None:
        """Seed the RNG the model's own random draws (its dropout) take, before a micro-batch."""
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed, device=self.device)

    @property
    def updated_state_tensors(self) -> int | None:
        """How many state tensors the captured step updates in place (None before its capture, or
        when traced every step): with parameter aliasing on, each should donate its buffer."""
        if self.gradients is None or not self.gradients.captured:
            return None
        return len(self.gradients.updated) + len(self.update.updated)

    @property
    def updated_state_bytes(self) -> int | None:
        if self.gradients is None or not self.gradients.captured:
            return None
        model, optimizer = model_state(self.model), optimizer_state(self.optimizer)
        tensors = [model[i] for i in self.gradients.updated] + [optimizer[i] for i in self.update.updated]
        return sum(t.numel() * t.element_size() for t in tensors)

    def run(self, micro_batches: list[dict], seeds: list[int], lr_and_active, lr_examples) -> dict:
        if self.gradients is None:
            self.optimizer.lr, active = lr_and_active()
            return train_step(self.model, self.optimizer, micro_batches, max_grad_norm=self.max_grad_norm,
                              collectives=self.parallel.collectives, packed=self.packed, loss_chunk=self.loss_chunk,
                              seeds=seeds, active=active, seed_rng=self.seed_rng, objective=self.objective)
        inputs = (micro_batches, torch.tensor(seeds, dtype=torch.int64).to(self.device))
        if not self.gradients.captured:
            self._capture(inputs, lr_examples())
        sums = self.gradients(inputs)
        sums = self.parallel.collectives.sum_device([sums[k] for k in self.sums])
        lr, active = lr_and_active()  # (after the capture: nothing of the step may be pending then)
        results = self.update(sums[:len(SUMS)] + [lr] + ([active] if active is not None else []))
        self.optimizer.lr = lr  # (the update's trace left its example there)
        return {**results, "metric_sums": sums[len(SUMS)]} if self.objective is not None else results

    def _capture(self, inputs: tuple[list[dict], torch.Tensor], lr_examples: list[torch.Tensor]) -> None:
        """Both traces, before anything of the first step is pending (see CapturedStep.capture):
        the gradients on the first step's inputs, the update on zeros of their results' shapes
        and of the LR's (and, side by side, of which adapters step)."""
        sums = self.gradients.capture(inputs)
        examples = [torch.zeros(sums[k][0], dtype=sums[k][1]) for k in SUMS] + lr_examples
        self.update.capture([t.to(self.device) for t in examples])


# What the gradients graph returns and the update takes, in this order: the step's flat LoRA
# gradient, loss sum and label tokens, each summed over its micro-batches (then over replicas).
SUMS = ("grad", "loss_total", "tokens")


def model_state(model) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def optimizer_state(optimizer: MaskedAdamW) -> list[torch.Tensor]:
    return optimizer.params + optimizer.state_tensors()


def gradient_sums(model, optimizer: MaskedAdamW, packed: bool, loss_chunk, objective,
                  inputs: tuple[list[dict], torch.Tensor]) -> dict:
    """Traced once: (the step's micro-batches, their seeds [grad_accum]) -> the SUMS (and a
    preference objective's metric sums)."""
    micro_batches, seeds = inputs
    grad, loss_total, tokens, *metrics = summed_over_micro_batches(
        lambda batch: micro_batch_gradients(model, optimizer, batch, packed, loss_chunk, objective),
        micro_batches, seeds, reads=model_state(model))
    # [1] (or [K] side by side), not 0-dim: the update is traced on zeros of these shapes, and
    # a 0-dim zero reaches the device as a constant, not as data.
    sums = {"grad": grad, "loss_total": loss_total.reshape(-1), "tokens": tokens.reshape(-1)}
    return {**sums, "metric_sums": metrics[0]} if metrics else sums


def update_from_sums(optimizer: MaskedAdamW, max_grad_norm: float, inputs: list[torch.Tensor]) -> dict:
    """Traced once: the summed gradient, loss and label tokens, the LR (and, side by side, which
    adapters step) -> the update."""
    grad, loss_total, tokens, lr, *active = inputs
    optimizer.lr = lr
    if optimizer.group_count == 1:
        loss_total, tokens = loss_total.reshape(()), tokens.reshape(())
    return apply_update(optimizer, grad, loss_total, tokens, max_grad_norm, active[0] if active else None)
