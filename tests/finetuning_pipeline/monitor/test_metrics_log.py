"""What TensorBoard and W&B plot of a record (`record_scalars`), for one adapter and for
adapters side by side, and the loss plot's line per adapter."""

from __future__ import annotations

import json

from finetuning_pipeline.monitor.metrics_log import plot_losses, record_scalars


def test_a_records_numbers_and_each_side_by_side_adapters_are_plotted():
    record = {"kind": "train", "step": 3, "loss": 2.5, "lr": None, "grad_norm": None, "label_tokens": 96,
              "skipped_steps": 0, "adapters": {"sql": {"loss": 2.0, "lr": 1e-3, "grad_norm": 0.5},
                                               "chat": {"loss": 3.0, "lr": 5e-4, "grad_norm": float("nan")}}}
    scalars = record_scalars(record)
    assert scalars["train/loss"] == 2.5 and "train/lr" not in scalars  # no top-level LR side by side
    assert scalars["train/sql/loss"] == 2.0 and scalars["train/chat/lr"] == 5e-4
    assert "train/chat/grad_norm" in scalars and "train/adapters" not in scalars
    assert record_scalars({"kind": "eval", "step": 0, "loss": 1.0, "flag": True}) == {"eval/loss": 1.0}


def test_the_loss_plot_draws_a_line_per_adapter_side_by_side(tmp_path, monkeypatch):
    records = [{"kind": "train", "step": s, "loss": 3.0 - s / 10, "adapters": {"sql": {"loss": 3.0 - s / 5},
                                                                                "chat": {"loss": 3.0 - s / 20}}}
               for s in range(1, 6)]
    records.append({"kind": "eval", "step": 5, "loss": 2.6, "adapters": {"sql": {"loss": 2.1}, "chat": {"loss": 2.8}}})
    (tmp_path / "phase1").mkdir()
    (tmp_path / "phase1" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append(kwargs.get("label"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", plot)
    path = plot_losses(tmp_path, [1])
    assert path.stat().st_size > 10_000
    assert sorted(drawn) == ["phase 1 chat eval", "phase 1 chat train", "phase 1 sql eval", "phase 1 sql train"]


def test_a_preference_phase_plots_its_loss_per_pair_and_its_reward_margin_on_an_axis_of_its_own(tmp_path,
                                                                                                monkeypatch):
    text = [{"kind": "train", "step": s, "loss": 3.0 - s / 10} for s in range(1, 4)]
    pairs = [{"kind": "train", "step": s, "loss": 0.69 - s / 100, "rewards/margins": s / 10} for s in range(1, 4)]
    pairs.append({"kind": "eval", "step": 3, "loss": 0.6, "rewards/margins": 0.25})
    for phase, records in ((1, text), (2, pairs)):
        (tmp_path / f"phase{phase}").mkdir()
        (tmp_path / f"phase{phase}" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    import matplotlib.pyplot as plt

    drawn = []
    real = plt.Axes.plot

    def plot(self, *args, **kwargs):
        drawn.append((self.get_ylabel() or id(self), kwargs.get("label"), list(args[1])))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(plt.Axes, "plot", plot)
    assert plot_losses(tmp_path, [1, 2]).stat().st_size > 10_000
    labels = [label for _, label, _ in drawn]
    assert "phase 2 (preference loss, per pair) train" in labels and "phase 1 train" in labels
    margins = [(axis, values) for axis, label, values in drawn if label in ("phase 2 train", "phase 2 eval")]
    assert [values for _, values in margins] == [[0.1, 0.2, 0.3], [0.25]]
    loss_axis = next(axis for axis, label, _ in drawn if label == "phase 1 train")
    assert all(axis != loss_axis for axis, _ in margins)  # the margins on an axis of their own
