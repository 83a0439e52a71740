"""The divergence monitor: steps with a non-finite loss or gradient norm.

Such a step is skipped on the device (the optimizer leaves adapter and state unchanged, see
adamw.py); this monitor counts them on the device too, so no step waits on the host. The
counts reach the host only at log steps, in a step closure; `train.max_bad_steps` skipped
steps in a row then stop the run. The losses are summed over the replicas before the check,
so every replica sees the same counts and takes the same decision.
"""

from __future__ import annotations

import torch

from finetuning_pipeline.errors import TrainingDiverged
from utils.xla_runtime import device_counter


class DivergenceMonitor:
    def __init__(self, device, max_bad_steps: int) -> None:
        self.max_bad_steps = max_bad_steps
        self.skipped = device_counter(0, device)  # skipped steps in the phase so far
        self.bad_run = device_counter(0, device)  # consecutive skipped steps, 0 after a good one
        self.worst_bad_run = device_counter(0, device)
        self.seen_worst_bad_run = 0  # host copy, as of the last log step

    def device_state(self) -> list[torch.Tensor]:
        return [self.skipped, self.bad_run, self.worst_bad_run]

    def update(self, applied: torch.Tensor) -> None:
        """Traced into the step: `applied` is False where the optimizer skipped the update."""
        bad = (~applied).to(torch.float32)
        self.skipped = self.skipped + bad
        self.bad_run = (self.bad_run + 1) * bad
        self.worst_bad_run = torch.maximum(self.worst_bad_run, self.bad_run)

    def observe(self, worst_bad_run: float) -> None:
        """Host values read in a log step's closure."""
        self.seen_worst_bad_run = int(worst_bad_run)

    def check(self, phase: int, step: int, last_good_checkpoint) -> None:
        """last_good_checkpoint: a callable, asked only when the run has to stop."""
        if self.seen_worst_bad_run >= self.max_bad_steps:
            raise TrainingDiverged(
                f"phase {phase} stopped at step {step}: {self.seen_worst_bad_run} consecutive steps had a non-finite "
                f"loss or gradient norm (train.max_bad_steps={self.max_bad_steps}); their updates were skipped, "
                f"nothing non-finite was saved. Last good checkpoint: {last_good_checkpoint() or 'none'}. Lower "
                f"train.lr (or phase{phase}.lr) or check the data, then continue from it with --resume auto "
                "--accept-changes (a changed learning rate makes the run no longer exact; the summary records it)"
            )

    def state_dict(self) -> dict:
        """The counts as of the step that just ran (a checkpoint's step): one small transfer,
        at checkpoint time only, after the step's sync."""
        return {"skipped_steps": int(self.skipped.cpu().item())}

    def load_state_dict(self, state: dict, device) -> None:
        self.skipped = device_counter(state.get("skipped_steps", 0), device)
