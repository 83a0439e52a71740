"""Weights & Biases, for users who track their runs there: optional, never needed.

`logging.wandb.project` set: the master replica opens one W&B run per phase, named
`<name or output_dir's name>-phase<N>`, with the run config; every record written to
`phaseN/metrics.jsonl` is logged at its step (`train/loss`, `eval/perplexity`, ...), and the
phase's summary goes into the run's summary. The run id is kept in `phaseN/wandb_run_id`, so a
resumed phase continues its run (W&B drops the steps it already has). `logging.wandb.mode`
(online, offline, disabled) defaults to W&B's own setting (`WANDB_MODE`); offline runs are
synced later with `wandb sync`. Needs `pip install 'tpu-lora[wandb]'`: checked before the
device is touched.
"""

from __future__ import annotations

import secrets
from pathlib import Path

from finetuning_pipeline.monitor.metrics_log import record_scalars


class WandbLog:
    """One phase's W&B run: `write` a metrics record, `finish` with the phase summary (or None)."""

    def __init__(self, settings, phase: int, phase_dir: Path, run_config: dict, resuming: bool) -> None:
        import wandb

        phase_dir.mkdir(parents=True, exist_ok=True)
        id_file = phase_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else secrets.token_hex(4)
        name = settings.name or Path(run_config["output_dir"]).name
        self.run = wandb.init(project=settings.project, entity=settings.entity, name=f"{name}-phase{phase}",
                              id=run_id, resume="allow", mode=settings.mode, dir=str(phase_dir),
                              config={**run_config, "phase": phase}, reinit="create_new")
        id_file.write_text(run_id)

    def write(self, record: dict) -> None:
        self.run.log(record_scalars(record), step=record["step"])

    def finish(self, summary: dict | None) -> None:
        if summary is not None:
            self.run.summary.update({key: value for key, value in summary.items()
                                     if isinstance(value, (int, float, str, bool)) or value is None})
        self.run.finish()
