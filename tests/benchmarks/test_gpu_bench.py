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
