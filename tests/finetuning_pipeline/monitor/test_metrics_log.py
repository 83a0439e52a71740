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
