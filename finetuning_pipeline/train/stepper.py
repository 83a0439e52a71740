"""One optimizer step, whatever runs it: the seeds of its random numbers, the LR from the schedule
table, which adapters step, and the running counts. The step itself is executed by the phase's
runtime (runtime/protocol.py's StepExecution: captured once and replayed on XLA, eager or with
compiled layers natively), from train/step.py's arithmetic.
"""

from __future__ import annotations

import torch

from finetuning_pipeline.distributed.parallel import Parallel
from finetuning_pipeline.model.causal_lm_loss import resolve_chunk_tokens
from finetuning_pipeline.run_config import TrainConfig
from finetuning_pipeline.train.lr_schedule import lr_table
from utils.device_tensors import device_counter


def step_seed(seed: int, phase: int, rank: int, step: int) -> int:
    """The RNG seed of one training step (distinct per phase, replica and step; < 2**63)."""
    return (((seed * 3 + phase) * 1_000_003 + rank) * 1_000_000_007 + step) % (2**63 - 1)


def micro_batch_seeds(seed: int, phase: int, rank: int, step: int, count: int) -> list[int]:
    """The seed of each micro-batch of a step: the runtime's RNG seed for it (the model's own
    dropout, which draws from the device's RNG: it follows the split of the global batch)."""
    first = step_seed(seed, phase, rank, step)
    return [(first * 1_000_003 + i) % (2**63 - 1) for i in range(count)]


class Stepper:
    """One optimizer step on the device: the micro-batches' seeds (LoRA dropout masks, the model's
    own dropout), the LR from the schedule table, which adapters step, and the running label-token
    count; the step's execution is the runtime's (`runtime.step_execution`). The step count lives
    on the device (an integer [1]: see device_zeros), so nothing per step crosses from the host but
    the seeds."""

    def __init__(self, model, optimizer, train: TrainConfig, *, phase: int, lr: float | list[float],
                 max_steps: int | list[int], activation_checkpointing: bool, parallel: Parallel, device,
                 start_step: int, packed: bool, runtime, objective=None) -> None:
        """train: the train section (seed, clipping, schedule shape, chunked loss, capture_step);
        lr, max_steps: the phase's peak LR and length, or a list of each adapter's, for an
        optimizer of adapters side by side (its groups); activation_checkpointing: the model's
        layers are recomputed in the backward (model.activation_checkpointing); runtime: what
        executes the step (runtime/protocol.py); objective: a preference phase's loss (train/step.py),
        None for next-token loss."""
        t = train
        self.optimizer, self.parallel, self.device = optimizer, parallel, device
        self.seed, self.phase = t.seed, phase
        self.loss_chunk = resolve_chunk_tokens(t.loss_chunk_tokens, model.config)
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
        self.execution = runtime.step_execution(model, optimizer, train=t, parallel=parallel, device=device,
                                                packed=packed, loss_chunk=self.loss_chunk,
                                                activation_checkpointing=activation_checkpointing, objective=objective)

    @property
    def note(self) -> str | None:
        """A line for the phase's start about how its steps run, or None."""
        return self.execution.note

    @property
    def updated_state_tensors(self) -> int | None:
        """How many state tensors the step updates in place, where the runtime donates their
        buffers (XLA with parameter aliasing on; None before the first step, and elsewhere)."""
        return self.execution.updated_state_tensors

    @property
    def updated_state_bytes(self) -> int | None:
        """The bytes of those tensors: what their donation saves on every device (the LoRA
        weights and their optimizer state are replicated under fsdp, not sharded)."""
        return self.execution.updated_state_bytes

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

    def lr_examples(self) -> list[torch.Tensor]:
        """Host zeros of the shapes lr_and_active returns (the LR [1], or [K] side by side, and
        which adapters step): what a runtime that captures the step traces its update on, with
        nothing of the step pending (lr_and_active would trace a lookup)."""
        if not self.grouped:
            return [torch.zeros(self.step_count.shape, dtype=self.schedule.dtype)]
        adapters = self.schedule.shape[1]
        return [torch.zeros(adapters, dtype=self.schedule.dtype), torch.zeros(adapters, dtype=torch.bool)]

    def __call__(self, step: int, micro_batches: list[dict]) -> dict:
        # LoRA dropout's masks come with the batch, a seed per sequence from its place in the
        # global stream (phase_data.py); the model's own dropout draws from the runtime's RNG,
        # seeded from (seed, phase, rank, step k) and the micro-batch: so a resumed run draws the
        # masks the uninterrupted one drew (restoring torch_xla's saved RNG state did not: same
        # state read back, different masks). New seeds each step are data, not a recompile.
        seeds = micro_batch_seeds(self.seed, self.phase, self.parallel.rank, step, len(micro_batches))
        results = self.execution.run(micro_batches, seeds, self.lr_and_active, self.lr_examples)
        if self.grouped:
            # Per-adapter results are sums over batch-sharded rows: under SPMD, propagation shards
            # them on the adapter axis, and each read on the host (log steps) or next step's input
            # would compile a resharding of its own. Replicated, like every [1] result.
            self.parallel.replicate(list(results.values()))
        self.label_tokens = self.label_tokens + results["tokens"]
        self.step_count = self.step_count + 1
        return {**results, "lr": self.optimizer.lr}


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
