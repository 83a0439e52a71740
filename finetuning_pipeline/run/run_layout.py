"""Where a run's outputs go, and who may write there: the one owner of the layout.

    output_dir/
      .lock                       held by the running job's master (pid, host, start time)
      loss.png                    every phase's losses
      preflight.json              `python -m finetuning_pipeline.preflight`
      tpu_check.json              `make tpu-check`: its checks and the chip's measured figures
      tpu_check/                  the self-check's own: runs/ (its small runs), host<N>/ (each host's model, data, log)
      phaseN/adapter/             the phase's final adapter (PEFT layout)
      phaseN/adapters/<name>/     instead, each adapter the phase trained side by side
      phaseN/checkpoints/         step_XXXXXXXX/, complete ones carry a COMPLETE marker
      phaseN/metrics.jsonl        train and eval records
      phaseN/tb/                  TensorBoard scalars
      phaseN/summary.json         written last: the phase is done

The lock is an advisory `flock` on `.lock`: the kernel drops it when its process dies, so a
killed run's lock is simply taken over by the next run (the file's content then names the new
holder). Two jobs on different hosts sharing a network disk are only kept apart where that
file system honours flock.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
from pathlib import Path

from finetuning_pipeline.errors import ConfigError
from lora_logic.config import DEFAULT_ADAPTER
from utils.output_guard import overlaps

# What a run writes inside phaseN/: --resume never --force replaces a phase directory only when
# it holds nothing else.
# wandb/ and wandb_run_id: W&B's files, when logging.wandb is set (wandb_log.py).
PHASE_ENTRIES = frozenset({"adapter", "adapters", "checkpoints", "metrics.jsonl", "tb", "summary.json", "wandb",
                           "wandb_run_id", "reference_logps.npy"})


class RunLayout:
    def __init__(self, output_dir: str | Path) -> None:
        self.root = Path(output_dir)

    def written_paths(self) -> list[Path]:
        return [self.phase_dir(1), self.phase_dir(2), self.loss_plot, self.preflight, self.tpu_check,
                self.tpu_check_runs, self.lock_file]

    def check_apart_from(self, inputs: dict[str, str | None]) -> None:
        """The run never writes into its inputs: output_dir may hold them (the demo keeps its
        data there) but may not lie inside one, and nothing the run writes may be or hold one."""
        root = self.root.resolve()
        for key, path in inputs.items():
            if not path:
                continue
            resolved = Path(path).resolve()
            if root == resolved or resolved in root.parents:
                raise ConfigError(f"output_dir: {self.root} is {key} ({path}) or lies inside it; a run never writes "
                                  "into its inputs. Choose another output_dir")
            for written in self.written_paths():
                if overlaps(written, resolved):
                    raise ConfigError(f"output_dir: the run writes {written}, which overlaps {key} ({path}); choose "
                                      "another output_dir")

    def foreign_entries(self, phase: int) -> list[str]:
        """What phaseN/ holds that no run wrote (so --force must not delete it)."""
        directory = self.phase_dir(phase)
        if not directory.is_dir():
            return [directory.name] if directory.exists() else []
        return sorted(p.name for p in directory.iterdir() if p.name not in PHASE_ENTRIES)

    def phase_dir(self, phase: int) -> Path:
        return self.root / f"phase{phase}"

    def adapter(self, phase: int) -> Path:
        return self.phase_dir(phase) / "adapter"

    def side_by_side_adapters(self, phase: int) -> Path:
        """Adapters trained side by side: `<name>/` each, in PEFT's layout."""
        return self.phase_dir(phase) / "adapters"

    def adapters(self, phase: int, names: list[str]) -> dict[str, Path]:
        """Where a phase's set of adapters is written: its one adapter in `adapter/`, adapters
        side by side in `adapters/<name>/` each."""
        return adapter_dirs(names, self.adapter(phase), self.side_by_side_adapters(phase))

    def checkpoints(self, phase: int) -> Path:
        return self.phase_dir(phase) / "checkpoints"

    def metrics(self, phase: int) -> Path:
        return self.phase_dir(phase) / "metrics.jsonl"

    def tensorboard(self, phase: int) -> Path:
        return self.phase_dir(phase) / "tb"

    def summary(self, phase: int) -> Path:
        return self.phase_dir(phase) / "summary.json"

    def reference_logps(self, phase: int) -> Path:
        """A preference phase's precomputed reference log-probabilities (preference.precompute_reference)."""
        return self.phase_dir(phase) / "reference_logps.npy"

    @property
    def loss_plot(self) -> Path:
        return self.root / "loss.png"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def tpu_check(self) -> Path:
        return self.root / "tpu_check.json"

    @property
    def tpu_check_runs(self) -> Path:
        return self.root / "tpu_check"

    @property
    def lock_file(self) -> Path:
        return self.root / ".lock"


class OutputLock:
    """An exclusive lock on an output directory for as long as the run lives (a context manager)."""

    def __init__(self, layout: RunLayout) -> None:
        self.path = layout.lock_file
        self.fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._read_holder(fd)
            os.close(fd)
            raise ConfigError(
                f"output_dir: {self.path.parent} is in use by another run ({holder}); wait for it to finish, "
                "stop it, or choose another output_dir"
            ) from None
        holder = {"pid": os.getpid(), "host": socket.gethostname(),
                  "started": datetime.datetime.now().isoformat(timespec="seconds")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        self.fd = fd

    @staticmethod
    def _read_holder(fd: int) -> str:
        try:
            holder = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
            return f"pid {holder['pid']} on host {holder['host']}, started {holder['started']}"
        except (ValueError, KeyError):
            return "holder unknown"

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> "OutputLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def adapter_dirs(names: list[str], alone: Path, side_by_side: Path) -> dict[str, Path]:
    """{adapter: its directory}: a run's one adapter (DEFAULT_ADAPTER) in `alone`, adapters side by
    side in `side_by_side/<name>/` each (the layout of a phase's outputs and of a checkpoint)."""
    if names == [DEFAULT_ADAPTER]:
        return {DEFAULT_ADAPTER: alone}
    return {name: side_by_side / name for name in names}
