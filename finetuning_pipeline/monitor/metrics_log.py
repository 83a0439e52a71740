"""Metrics of a phase: JSON lines (`phaseN/metrics.jsonl`), TensorBoard scalars, and the
run's loss plot (`loss.png`). Written by the master replica only.

Records are dicts with "kind" ("train" or "eval") and "step"; training records are written
from step closures, possibly on torch_xla's closure thread, hence the lock.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from finetuning_pipeline.monitor.console import step_line
from finetuning_pipeline.run.run_layout import RunLayout
from utils.output_guard import staged_file


class MetricsLog:
    """Every record to metrics.jsonl, and to TensorBoard and W&B (a wandb_log.WandbLog) when given."""

    def __init__(self, path: str | Path, tensorboard_dir: str | Path | None = None, resume_step: int | None = None,
                 wandb=None) -> None:
        self.path = Path(path)
        self.wandb = wandb
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        # Steps whose evaluation is logged: a phase resumed from its final checkpoint (its outputs
        # could not be written) evaluates that step again, and logs it once.
        self.evaluated: set[int] = set()
        if resume_step is None:
            self.path.write_text("")
        else:
            self.truncate_after(resume_step)
        self.tb = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(tensorboard_dir))

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step`: a resumed run redoes them, and must not log them twice."""
        if not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
        self.path.write_text("".join(line + "\n" for line in kept))
        self.evaluated = {json.loads(line)["step"] for line in kept if json.loads(line)["kind"] == "eval"}

    def write(self, record: dict) -> None:
        with self.lock:
            if record["kind"] == "eval":
                if record["step"] in self.evaluated:
                    return
                self.evaluated.add(record["step"])
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self.tb is not None:
                for key, value in record_scalars(record).items():
                    self.tb.add_scalar(key, value, record["step"])
            if self.wandb is not None:
                self.wandb.write(record)

    def close(self, summary: dict | None = None) -> None:
        """summary: the finished phase's, for W&B's run summary (None when the phase stopped)."""
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish(summary)


def record_scalars(record: dict) -> dict[str, float]:
    """A record's numbers as TensorBoard and W&B plot them: "train/loss", ..., and side by side
    each adapter's, "train/<adapter>/loss", ... (flags, text and missing values left out)."""
    values = {key: value for key, value in record.items() if key not in ("kind", "step", "adapters")}
    for name, each in record.get("adapters", {}).items():
        values.update({f"{name}/{key}": value for key, value in each.items()})
    return {f"{record['kind']}/{key}": value for key, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)}


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


MARGIN = "rewards/margins"  # a preference phase's reward margin (model/preference_loss.py)


def plot_losses(output_dir: str | Path, phases: list[int]) -> Path | None:
    """Train and eval loss of the run's `phases` on one axis, in order (phase N's steps follow
    phase N-1's); a phase with no metrics yet is left out. A preference phase's loss is its
    preference loss (per pair, labelled so), and its reward margin gets an axis of its own below."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = RunLayout(output_dir)
    metrics = {phase: read_metrics(layout.metrics(phase)) for phase in phases}
    preference = any(MARGIN in r for records in metrics.values() for r in records)
    if preference:
        fig, (ax, margin_ax) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=[2, 1])
    else:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    offset = 0
    plotted = False
    for phase in phases:
        color = f"C{(phase - 1) % 10}"  # matplotlib's colour cycle: phase 1 blue, phase 2 orange, ...
        records = metrics[phase]
        if any(MARGIN in r for r in records):
            plot_margins(margin_ax, records, offset, color, phase)
        adapters = sorted({name for r in records for name in r.get("adapters", {})})
        # Side by side: a line per adapter (the phase's colour, a marker each), else the phase's loss.
        lines = [(f"phase {phase} {name}", name, marker) for name, marker in zip(adapters, "s^vD<>ph*x" * 10)] or [
            (f"phase {phase}" + (" (preference loss, per pair)" if any(MARGIN in r for r in records) else ""),
             None, None)]
        for label, name, marker in lines:
            def loss(r):
                return r["loss"] if name is None else r.get("adapters", {}).get(name, {}).get("loss")

            train = [(r["step"] + offset, loss(r)) for r in records if r["kind"] == "train" and loss(r) is not None]
            evals = [(r["step"] + offset, loss(r)) for r in records if r["kind"] == "eval" and loss(r) is not None]
            if train:
                ax.plot(*zip(*train), color=color, alpha=0.8, marker=marker, markevery=max(1, len(train) // 8),
                        label=f"{label} train")
                plotted = True
            if evals:
                ax.plot(*zip(*evals), color=color, marker=marker or "o", linestyle="--", label=f"{label} eval")
                plotted = True
        if records:
            offset += max(r["step"] for r in records)
            ax.axvline(offset, color="grey", linewidth=0.5)
    if not plotted:
        plt.close(fig)
        return None
    (margin_ax if preference else ax).set_xlabel("optimizer step (each phase continues after the one before)")
    ax.set_ylabel("loss (nats per label token; a preference phase's per pair)" if preference else
                  "loss (nats per label token)")
    ax.set_title("Training and eval loss")
    ax.legend()
    ax.grid(alpha=0.3)
    if preference:
        margin_ax.set_ylabel("reward margin")
        margin_ax.legend()
        margin_ax.grid(alpha=0.3)
    path = layout.loss_plot
    fig.tight_layout()
    with staged_file(path) as partial:  # a reader never sees half a PNG
        fig.savefig(partial, dpi=100, format="png")
    plt.close(fig)
    return path


def plot_margins(ax, records: list[dict], offset: int, color: str, phase: int) -> None:
    """A preference phase's reward margin (chosen minus rejected reward, TRL's rewards/margins),
    train and eval, on its own axis."""
    for kind, style in (("train", "-"), ("eval", "--")):
        points = [(r["step"] + offset, r[MARGIN]) for r in records if r["kind"] == kind and r.get(MARGIN) is not None]
        if points:
            ax.plot(*zip(*points), color=color, linestyle=style, marker="o" if kind == "eval" else None,
                    label=f"phase {phase} {kind}")


class StepLogger:
    """A phase's training records and progress bar. Every replica calls `log` from the same
    step closures (so they agree on what they saw); only the master writes.

    tokens/s and ETA are measured between log steps, from the closures' times (a closure runs
    once its step has executed)."""

    def __init__(self, log: MetricsLog | None, progress, tokens_per_step: int, max_steps: int,
                 first_loss: float | None = None, adapter_losses: dict | None = None,
                 print_steps_as: str | None = None) -> None:
        """print_steps_as: with no progress bar, the master prints a line per log step labelled so
        ("phase 1"); None prints nothing."""
        self.log = log
        self.progress = progress
        self.print_steps_as = print_steps_as
        self.tokens_per_step = tokens_per_step
        self.max_steps = max_steps
        self.first_loss = first_loss
        # Side by side: each adapter's first and latest logged values ({"first": {name: values}, "last": ...}).
        self.adapter_losses = adapter_losses or {"first": {}, "last": {}}
        self._last: tuple[float, int] | None = None

    def log_train(self, step: int, values: dict, adapters: dict[str, dict] | None = None) -> None:
        """values: host floats of loss, lr, grad_norm, label_tokens, skipped_steps (a preference
        phase's: its pairs for label_tokens, and its metrics under TRL's names, "rewards/margins",
        ..., written beside them); adapters: the same of each adapter side by side (the record's
        "adapters"; values then hold their token-weighted mean loss and total tokens)."""
        now = time.perf_counter()
        rate = None
        if self._last is not None:
            rate = (step - self._last[1]) * self.tokens_per_step / (now - self._last[0])
        self._last = (now, step)
        if self.first_loss is None:
            self.first_loss = values["loss"]
        for name, each in (adapters or {}).items():
            self.adapter_losses["first"].setdefault(name, each)
            self.adapter_losses["last"][name] = each
        if self.log is None:
            return
        record = {"kind": "train", "step": step, "loss": values["loss"], "lr": values["lr"],
                  "grad_norm": values["grad_norm"], "label_tokens": int(values["label_tokens"]),
                  "skipped_steps": int(values["skipped_steps"])}
        record.update({key: value for key, value in values.items() if "/" in key})  # TRL's metric names
        if adapters is not None:
            record["adapters"] = adapters
        if rate:
            record["tokens_per_sec"] = round(rate, 1)
            record["eta_s"] = round((self.max_steps - step) * self.tokens_per_step / rate, 1)
        self.log.write(record)
        if self.print_steps_as is not None:
            print(step_line(self.print_steps_as, step, self.max_steps, values, adapters, rate, record.get("eta_s")),
                  flush=True)
        if self.progress is not None:
            self.progress.set_postfix(
                loss=f"{values['loss']:.4f}", tok_s=f"{rate:,.0f}" if rate else "-", refresh=False
            )

    def log_eval(self, step: int, result: dict) -> None:
        if self.log is not None:
            self.log.write({"kind": "eval", "step": step, **result})

    def advance(self) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def state_dict(self) -> dict:
        state = {"train_loss_first": self.first_loss}
        if self.adapter_losses["first"]:
            state["adapter_losses"] = self.adapter_losses
        return state

    def close(self, summary: dict | None = None) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.log is not None:
            self.log.close(summary)
