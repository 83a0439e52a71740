"""One optimizer step on the device, and the seeds of its random numbers.

`Stepper` runs a step as two captured graphs (step_capture.py): the gradients of every
micro-batch (one XLA loop: micro_batch_loop.py) and the update; the sums over replicas sit
between them. `step.train_step` is the same step traced every time (train.capture_step=false).
"""

from __future__ import annotations

import functools

import torch

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.model.causal_lm_loss import resolve_chunk_tokens
from finetuning_pipeline.runtime.xla.scan_choice import model_dropouts
from finetuning_pipeline.run_config import TrainConfig
from finetuning_pipeline.train.adamw import MaskedAdamW
from finetuning_pipeline.train.lr_schedule import lr_table
from finetuning_pipeline.runtime.xla.micro_batch_loop import summed_over_micro_batches
from finetuning_pipeline.train.step import apply_update, micro_batch_gradients, train_step
from finetuning_pipeline.runtime.xla.step_capture import CapturedStep
from finetuning_pipeline.runtime.xla.device import device_counter


def step_seed(seed: int, phase: int, rank: int, step: int) -> int:
    """The XLA RNG seed of one training step (distinct per phase, replica and step; < 2**63)."""
    return (((seed * 3 + phase) * 1_000_003 + rank) * 1_000_000_007 + step) % (2**63 - 1)


def micro_batch_seeds(seed: int, phase: int, rank: int, step: int, count: int) -> list[int]:
    """The seed of each micro-batch of a step: torch_xla's RNG seed for it and, mod 2**31, its
    LoRA dropout masks' (lora_logic/dropout.py)."""
    first = step_seed(seed, phase, rank, step)
    return [(first * 1_000_003 + i) % (2**63 - 1) for i in range(count)]


class Stepper:
    """One optimizer step on the device: the micro-batches' seeds (LoRA dropout masks, torch_xla's
    RNG), the LR from the schedule table, gradients, the sums over replicas, the update, and the
    running label-token count. The step count lives on the device (an integer [1]: see
    device_zeros), so nothing per step crosses from the host but the seeds.

    With train.capture_step (the default) the gradients (all micro-batches, in one XLA loop)
    and the update are each traced once, at the first step, and replayed after (step_capture.py);
    the sums over replicas sit between the two, as they need a host round trip under torchrun
    on a CPU. Otherwise `step.train_step` traces everything every step."""

    def __init__(self, model, optimizer, train: TrainConfig, *, phase: int, lr: float | list[float],
                 max_steps: int | list[int], activation_checkpointing: bool, parallel: Parallel, device,
                 start_step: int, packed: bool) -> None:
        """train: the train section (seed, clipping, schedule shape, chunked loss, capture_step);
        lr, max_steps: the phase's peak LR and length, or a list of each adapter's, for an
        optimizer of adapters side by side (its groups); activation_checkpointing: the model's
        layers are recomputed in the backward (model.activation_checkpointing)."""
        t = train
        self.model, self.optimizer, self.parallel, self.device = model, optimizer, parallel, device
        self.seed, self.phase, self.packed = t.seed, phase, packed
        self.loss_chunk = resolve_chunk_tokens(t.loss_chunk_tokens, model.config)
        self.max_grad_norm = t.max_grad_norm
        self.step_count = torch.tensor([start_step]).to(device)
        self.label_tokens = device_counter(0, device)
        if isinstance(lr, list):  # adapters side by side: a column per adapter (schedule_columns)
            schedule, active = schedule_columns(lr, max_steps, t)
            self.schedule, self.active_table = schedule.to(device), active.to(device)
            self.enabled = torch.ones(len(lr), dtype=torch.bool).to(device)
            self.label_tokens = torch.zeros(len(lr)).to(device)  # per adapter (device_zeros: data, not a constant)
        else:
            self.schedule = lr_table(peak=lr, warmup_steps=t.warmup_steps, total_steps=max_steps,
                                     min_lr_ratio=t.min_lr_ratio).to(device)
        self.gradients = self.update = None
        self.capture_note = None
        self.set_up_execution(t, activation_checkpointing)

    def set_up_execution(self, t: TrainConfig, activation_checkpointing: bool) -> None:
        """How the step runs on torch_xla: captured once (train.capture_step), or traced every step."""
        model, optimizer = self.model, self.optimizer
        dropouts = model_dropouts(model.config) if activation_checkpointing else {}
        if t.capture_step and dropouts:
            # torch random numbers in a recomputed layer cannot be replayed (step_capture.lower refuses them)
            named = ", ".join(f"{name} {p}" for name, p in dropouts.items())
            self.capture_note = (f"the step is traced every time: dropout in the model ({named}) with activation "
                                 "checkpointing draws random numbers the captured step cannot replay")
        elif t.capture_step:
            # The traced functions are bound to the pieces they read, not to this Stepper: a
            # CapturedStep holding the Stepper's own methods would be a reference cycle that kept
            # the phase's model and optimizer alive after it (until a garbage collection happened
            # to run), while the next phase loads its own.
            self.gradients = CapturedStep(
                functools.partial(gradient_sums, model, optimizer, self.packed, self.loss_chunk),
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
        """The bytes of those tensors: what their donation saves on every device (the LoRA
        weights and their optimizer state are replicated under fsdp, not sharded)."""
        if self.gradients is None or not self.gradients.captured:
            return None
        model, optimizer = model_state(self.model), optimizer_state(self.optimizer)
        tensors = [model[i] for i in self.gradients.updated] + [optimizer[i] for i in self.update.updated]
        return sum(t.numel() * t.element_size() for t in tensors)

    def device_state(self) -> list[torch.Tensor]:
        state = [self.step_count, self.schedule, self.label_tokens]
        return state + ([self.active_table, self.enabled] if self.grouped else [])

    @property
    def grouped(self) -> bool:
        """Adapters side by side: an LR, an active flag and results per adapter."""
        return self.schedule.dim() == 2

    def lr_and_active(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This step's LR ([1], or [K] side by side) and which adapters step (None: all)."""
        if not self.grouped:
            return self.schedule[self.step_count], None
        lr, active = self.schedule[self.step_count].reshape(-1), self.active_table[self.step_count].reshape(-1)
        self.parallel.replicate([lr, active])  # (see __call__)
        return lr, active & self.enabled

    def disable(self, groups: list[int]) -> None:
        """Leave these adapters as they are from the next step on (they diverged): new data
        for the step's graph, not a new graph."""
        enabled = self.enabled.cpu()
        enabled[groups] = False
        self.enabled = enabled.to(self.device)
        self.parallel.replicate([self.enabled])  # as at the start (an unmarked input is another graph under SPMD)

    def __call__(self, step: int, micro_batches: list[dict]) -> dict:
        # The random numbers of step k (LoRA and the model's dropout) depend on (seed, phase,
        # rank, k) and the micro-batch only, so a resumed run draws the masks the uninterrupted
        # one drew: restoring torch_xla's saved RNG state did not (same state read back,
        # different masks: verified with lora.dropout 0.1). New seeds each step are data for
        # the graph, not a recompile.
        seeds = micro_batch_seeds(self.seed, self.phase, self.parallel.rank, step, len(micro_batches))
        micro_batches = [{**batch, "lora_seed": torch.tensor([seed % 2**31], dtype=torch.int32).to(self.device)}
                         for batch, seed in zip(micro_batches, seeds)]
        if self.gradients is None:
            self.optimizer.lr, active = self.lr_and_active()
            results = self.run_step(micro_batches, seeds, active)
        else:
            inputs = (micro_batches, torch.tensor(seeds, dtype=torch.int64).to(self.device))
            if not self.gradients.captured:
                self._capture(inputs)
            sums = self.gradients(inputs)
            sums = self.parallel.collectives.sum_device([sums[k] for k in SUMS])
            lr, active = self.lr_and_active()  # (after the capture: nothing of the step may be pending then)
            results = self.update(sums + [lr] + ([active] if active is not None else []))
            self.optimizer.lr = lr  # (the update's trace left its example there)
        if self.grouped:
            # Per-adapter results are sums over batch-sharded rows: under SPMD, propagation shards
            # them on the adapter axis, and each read on the host (log steps) or next step's input
            # would compile a resharding of its own. Replicated, like every [1] result.
            self.parallel.replicate(list(results.values()))
        self.label_tokens = self.label_tokens + results["tokens"]
        self.step_count = self.step_count + 1
        return {**results, "lr": self.optimizer.lr}

    def run_step(self, micro_batches: list[dict], seeds: list[int], active: torch.Tensor | None) -> dict:
        """The step as it goes (not captured): step.train_step, the runtime's RNG seeded per micro-batch."""
        return train_step(self.model, self.optimizer, micro_batches, max_grad_norm=self.max_grad_norm,
                          collectives=self.parallel.collectives, packed=self.packed, loss_chunk=self.loss_chunk,
                          seeds=seeds, active=active, seed_rng=self.seed_rng)

    def _capture(self, inputs: tuple[list[dict], torch.Tensor]) -> None:
        """Both traces, before anything of the first step is pending (see CapturedStep.capture):
        the gradients on the first step's inputs, the update on zeros of their results' shapes."""
        sums = self.gradients.capture(inputs)
        examples = [torch.zeros(sums[k][0], dtype=sums[k][1]) for k in SUMS]
        # The LR ([1], or [K] side by side) and which adapters step: shapes only, so that nothing
        # is pending at the capture (lr_and_active would trace a lookup).
        adapters = self.schedule.shape[1] if self.grouped else None
        examples.append(torch.zeros(self.step_count.shape if adapters is None else (adapters,),
                                    dtype=self.schedule.dtype))
        if adapters is not None:
            examples.append(torch.zeros(adapters, dtype=torch.bool))
        self.update.capture([t.to(self.device) for t in examples])


# What the gradients graph returns and the update takes, in this order: the step's flat LoRA
# gradient, loss sum and label tokens, each summed over its micro-batches (then over replicas).
SUMS = ("grad", "loss_total", "tokens")


def model_state(model) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def optimizer_state(optimizer: MaskedAdamW) -> list[torch.Tensor]:
    return optimizer.params + optimizer.state_tensors()


def gradient_sums(model, optimizer: MaskedAdamW, packed: bool, loss_chunk,
                  inputs: tuple[list[dict], torch.Tensor]) -> dict:
    """Traced once: (the step's micro-batches, their seeds [grad_accum]) -> the SUMS."""
    micro_batches, seeds = inputs
    grad, loss_total, tokens = summed_over_micro_batches(
        lambda batch: micro_batch_gradients(model, optimizer, batch, packed, loss_chunk),
        micro_batches, seeds, reads=model_state(model))
    # [1] (or [K] side by side), not 0-dim: the update is traced on zeros of these shapes, and
    # a 0-dim zero reaches the device as a constant, not as data.
    return {"grad": grad, "loss_total": loss_total.reshape(-1), "tokens": tokens.reshape(-1)}


def update_from_sums(optimizer: MaskedAdamW, max_grad_norm: float, inputs: list[torch.Tensor]) -> dict:
    """Traced once: the summed gradient, loss and label tokens, the LR (and, side by side, which
    adapters step) -> the update."""
    grad, loss_total, tokens, lr, *active = inputs
    optimizer.lr = lr
    if optimizer.group_count == 1:
        loss_total, tokens = loss_total.reshape(()), tokens.reshape(())
    return apply_update(optimizer, grad, loss_total, tokens, max_grad_norm, active[0] if active else None)


def schedule_columns(peaks: list[float], max_steps: list[int], train: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Adapters side by side: ([steps, K] LR table, [steps, K] bool: adapter k steps at step
    t), steps = the longest adapter's. Column k is adapter k's own schedule (its peak, its
    length: what a run of it alone has); after its last step it repeats its last rate and is
    inactive, so the adapter stays as it ended."""
    steps = max(max_steps)
    columns, active = [], []
    for peak, total in zip(peaks, max_steps):
        table = lr_table(peak=peak, warmup_steps=train.warmup_steps, total_steps=total, min_lr_ratio=train.min_lr_ratio)
        columns.append(torch.cat([table, table[-1:].expand(steps - total)]))
        active.append(torch.arange(steps) < total)
    return torch.stack(columns, dim=1), torch.stack(active, dim=1)
