"""benchmarks/gpu_bench.py runs as written: the same three measurements a GPU runs (the native
runtime's step, the frozen floor, HF Trainer + PEFT), each in its own process, here on the demo's
shape on a CPU. The figures themselves are a GPU's to give (docs/benchmarks.md)."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks import gpu_bench

pytestmark = pytest.mark.slow


def test_the_gpu_benchmark_runs_its_three_measurements_on_a_cpu(tmp_path):
    out = tmp_path / "gpu_bench.json"
    result = gpu_bench.main(["--shape", "tiny", "--device", "cpu", "--batch", "2", "--seq-len", "64", "--steps", "4",
                             "--compile", "eager", "--profile", "--out", str(out)])
    assert json.loads(out.read_text())["tiny_cpu"] == result
    for kind in ("ours", "frozen", "peer"):
        assert result[kind]["step_time_s"] > 0 and result[kind]["tokens_per_sec"] == pytest.approx(
            2 * 64 / result[kind]["step_time_s"], rel=1e-3)
        assert result[kind]["peak_memory_bytes"] is None  # a CPU reports none
    assert math.isfinite(result["ours"]["last_loss"]) and 0 < result["ours"]["last_loss"] < 10
    assert result["lora_step_vs_frozen"] == pytest.approx(
        result["ours"]["step_time_s"] / result["frozen"]["step_time_s"], rel=1e-2)
    assert result["tokens_per_sec_vs_peer"] > 0 and result["torch"].startswith("2.")
    for kind in ("ours", "frozen"):  # --profile: one more step, its ops (a GPU's kernels) and their time
        profiled = result[kind]["profiled_step"]
        assert profiled["activity"] == "cpu" and profiled["time_ms"] > 0 and profiled["kernels"] > 0
    # the LoRA step runs more ops than the frozen forward and backward (its products, its update)
    assert result["ours"]["profiled_step"]["kernels"] > result["frozen"]["profiled_step"]["kernels"]


def test_the_memory_table_runs_every_base_and_checkpointing_row_on_a_cpu(tmp_path):
    """--table: ours for {bf16, q8_0, nf4} x {off, full, selective}, the long-context row, the
    checkpointed HF + PEFT peer; bitsandbytes' QLoRA peer said to be skipped where no GPU is."""
    out = tmp_path / "gpu_bench.json"
    result = gpu_bench.main(["--shape", "tiny", "--device", "cpu", "--batch", "2", "--seq-len", "64", "--steps", "3",
                             "--compile", "eager", "--table", "--long-context", "256", "--out", str(out)])
    assert json.loads(out.read_text())["tiny_cpu_table"] == result and result["complete"] is True
    ours = [(r["quantize"], r["checkpointing"], r["seq_len"]) for r in result["rows"] if r["who"] == "ours"]
    assert ours == [(q, c, 64) for q in ("none", "q8_0", "nf4") for c in ("off", "full", "selective")] + [
        ("nf4", "full", 256)]
    assert [(r["quantize"], r["checkpointing"]) for r in result["rows"] if r["who"] == "peer"] == [("none", "full")]
    assert "bitsandbytes" in result["skipped"]["qlora_peer"]
    for row in result["rows"]:
        assert row["step_time_s"] > 0 and row["tokens_per_sec"] == pytest.approx(
            row["batch"] * row["seq_len"] / row["step_time_s"], rel=1e-3)
        assert row["step_vs_frozen"] is None or row["step_vs_frozen"] == pytest.approx(
            row["step_time_s"] / result["frozen"]["step_time_s"], rel=1e-2)
        # ours' rows carry preflight's planned peak (a CPU's allocator reports none to hold it to)
        planned = row["planned_peak_bytes"]
        assert (planned > 0 if row["who"] == "ours" else planned is None) and row["peak_vs_planned"] is None


def test_a_failed_peer_loses_none_of_ours_rows_and_each_row_is_kept_as_measured(tmp_path, monkeypatch):
    """The table's peer (HF Trainer + PEFT) failing, peft missing say, once lost 12 minutes of our
    rows: the rows are written as each is measured, and the peer's failure is a skipped line."""
    out = tmp_path / "gpu_bench.json"
    seen = []

    def measured(kind, args, quantize="none", checkpointing="off"):
        if kind == "peer":
            raise SystemExit("peer failed:\nModuleNotFoundError: No module named 'peft'")
        if kind == "ours":  # the rows measured before this one are on disk already
            seen.append(len(json.loads(out.read_text())["tiny_cpu_table"]["rows"]) if out.exists() else 0)
        return {"step_time_s": 0.5, "peak_memory_bytes": None, "last_loss": 1.0}

    monkeypatch.setattr(gpu_bench, "in_subprocess", measured)
    result = gpu_bench.main(["--shape", "tiny", "--device", "cpu", "--batch", "2", "--seq-len", "64", "--steps", "3",
                             "--compile", "eager", "--table", "--long-context", "256", "--out", str(out)])
    assert seen == list(range(10)) and len(result["rows"]) == 10 and result["complete"] is True
    assert "No module named 'peft'" in result["skipped"]["peer_none"]
    assert json.loads(out.read_text())["tiny_cpu_table"] == result


def test_a_gpu_benchmark_on_a_machine_without_one_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(SystemExit) as exit_:
        gpu_bench.main(["--shape", "tiny"])  # --device cuda, the default
    assert exit_.value.code == 2 and "--device cuda: no CUDA GPU here; --device cpu" in capsys.readouterr().err
