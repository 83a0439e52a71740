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
from utils.device_tensors import device_counter


class DivergenceMonitor:
    """adapters: the names of adapters trained side by side (each counted on its own: `applied`
    is then [K], one flag per adapter), or None for one adapter."""

    def __init__(self, device, max_bad_steps: int, adapters: list[str] | None = None) -> None:
        self.max_bad_steps = max_bad_steps
        self.adapters = adapters
        self.device = device
        self.skipped = self._counters([0])  # skipped steps in the phase so far
        self.bad_run = self._counters([0])  # consecutive skipped steps, 0 after a good one
        self.worst_bad_run = self._counters([0])
        self.seen_worst_bad_run = 0  # host copy, as of the last log step
        self.seen_worst = [0] * len(adapters or [None])  # each adapter's, side by side
        self.diverged: dict[str, int] = {}  # side by side: adapter -> the step it was stopped at

    def _counters(self, values: list[float]) -> torch.Tensor:
        """A [1] device counter, or [K] side by side: data, not constants (device_counter)."""
        if self.adapters is None:
            return device_counter(values[0], self.device)
        values = values * len(self.adapters) if len(values) == 1 else values
        return torch.tensor([float(v) for v in values]).to(self.device)

    def device_state(self) -> list[torch.Tensor]:
        return [self.skipped, self.bad_run, self.worst_bad_run]

    def update(self, applied: torch.Tensor, skipped: torch.Tensor | None = None) -> None:
        """Traced into the step: `applied` is False where the optimizer skipped the update;
        side by side, `skipped` says which of those were skipped for a non-finite value (an
        adapter whose steps are done, or that was stopped, is not counted)."""
        bad = (~applied if skipped is None else skipped).to(torch.float32)
        self.skipped = self.skipped + bad
        self.bad_run = (self.bad_run + 1) * bad
        self.worst_bad_run = torch.maximum(self.worst_bad_run, self.bad_run)

    def observe(self, worst_bad_run) -> None:
        """Host values read in a log step's closure (a list side by side)."""
        self.seen_worst = [int(v) for v in worst_bad_run] if isinstance(worst_bad_run, list) else [int(worst_bad_run)]
        self.seen_worst_bad_run = max(self.seen_worst)

    def newly_diverged(self, step: int) -> list[int]:
        """Side by side: the adapters (indices) that reached train.max_bad_steps skipped steps in
        a row since the last check; the caller stops stepping them and the others go on, as
        each would alone. Recorded in `diverged`."""
        new = [k for k, worst in enumerate(self.seen_worst)
               if worst >= self.max_bad_steps and self.adapters[k] not in self.diverged]
        self.diverged.update({self.adapters[k]: step for k in new})
        return new

    def check(self, phase: int, step: int, last_good_checkpoint) -> None:
        """last_good_checkpoint: a callable, asked only when the run has to stop (side by side:
        when every adapter has diverged)."""
        if self.adapters is not None:
            if len(self.diverged) < len(self.adapters):
                return
            self.seen_worst_bad_run = max(self.seen_worst)
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
        at checkpoint time only, after the step's sync. Side by side: per adapter, and the
        adapters stopped for diverging."""
        counts = [int(v) for v in self.skipped.cpu().tolist()]
        if self.adapters is None:
            return {"skipped_steps": counts[0]}
        return {"skipped_steps": dict(zip(self.adapters, counts)), "diverged": dict(self.diverged)}

    def load_state_dict(self, state: dict, device) -> None:
        saved = state.get("skipped_steps", 0)
        self.skipped = self._counters([saved[a] for a in self.adapters] if isinstance(saved, dict) else [saved])
        self.diverged = dict(state.get("diverged", {}))
