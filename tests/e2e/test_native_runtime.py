"""The native runtime (runtime.backend=native: plain PyTorch on a CPU here) against the XLA
runtime, end to end on the tiny model, in float64 so that the two runtimes' different orders of
summation vanish and what remains is what each computes (tests/tolerances.py): the curriculum's
two phases, a q8_0 base with recomputed layers and the chunked loss, adapters side by side, the
embeddings and output layer trained in full (lora.modules_to_save); the
model's own dropout replayed in recomputed layers; a native run stopped by SIGTERM resumes
bitwise and imports no torch_xla; a checkpoint of one runtime resumes in the other; compiled
layers train as eager ones do. Those marked `native` run in `make test-native` too (torch 2.13,
no torch_xla)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from native_helpers import NATIVE, assert_runs_equal, sections_with, side_by_side
from tolerances import assert_within_bf16_rounding
from trainer_helpers import assert_same_run, metric_records, wait_for_step, write_run_config

from finetuning_pipeline import main

REPO = Path(__file__).resolve().parents[2]
CASES = {
    "curriculum": (lambda data: {}, ["all"], [1, 2]),
    # the chunked loss too (4 chunks of 64 tokens a micro-batch)
    "q8_0_base_recomputed": (lambda data: {"model": {"quantize": "q8_0", "activation_checkpointing": True},
                                           "train": {"loss_chunk_tokens": 64}}, ["1"], [1]),
    "side_by_side": (side_by_side, ["1"], [1]),
    # the embeddings and output layer trained in full beside the LoRA, at their own LR (phase 1: on
    # chat data, a prompt-only token's embedding row has a gradient small enough that AdamW's
    # normalization lifts the runtimes' float64 rounding to 2.5e-10 in 12 steps: measured, not bounded)
    "modules_to_save": (lambda data: {"lora": {"modules_to_save": ["embed_tokens", "lm_head"]},
                                      "train": {"embedding_lr": 2e-3}}, ["1"], [1]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_native_runtime_equals_the_xla_runtime(case, tiny_model_dir, data, tmp_path):
    extra, phase_arg, phases = CASES[case]
    sections = sections_with(**extra(data))
    outs = {}
    for backend in ("xla", "native"):
        out = tmp_path / backend
        config = write_run_config(tmp_path / f"{backend}.yaml", tiny_model_dir, data, out, **sections)
        assert main.main(["--config", str(config), "--phase", *phase_arg,
                          *(NATIVE if backend == "native" else [])]) == 0
        outs[backend] = out
    assert_runs_equal(outs["native"], outs["xla"], phases)
    summary = json.loads((outs["native"] / "phase1" / "summary.json").read_text())
    assert summary["runtime"] == "native" and summary["compiles_after_warmup"] == 0
    assert summary["host_syncs_per_step"] == 0  # counted by the profiler on step 2
    assert json.loads((outs["xla"] / "phase1" / "summary.json").read_text())["runtime"] == "xla"


# A meta path finder that refuses torch_xla and records every attempt (a caught ImportError too).
BLOCK_TORCH_XLA = """
import runpy, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch_xla":
            print(f"IMPORTED torch_xla: {name}", flush=True)
            raise ImportError(name)
sys.meta_path.insert(0, Refuse())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_attention_dropout(model_dir: Path, root: Path) -> Path:
    """A copy of the model whose attention draws dropout masks from torch's RNG (attention_dropout 0.1)."""
    import shutil

    copy = root / "model_with_dropout"
    shutil.copytree(model_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    return copy


@pytest.mark.native
def test_the_models_own_dropout_is_replayed_when_a_layer_is_recomputed(tiny_model_dir, data, tmp_path):
    """Attention dropout (torch's RNG, seeded per micro-batch) under activation checkpointing, full
    and selective: the recomputed layers draw the masks of their forward, so the run equals the
    one that keeps its activations (float64); had the recompute drawn new masks, the gradients
    would differ."""
    model = with_attention_dropout(tiny_model_dir, tmp_path)
    outs = {}
    for recomputed in ("full", "selective", False):
        out = tmp_path / f"recomputed_{recomputed}"
        config = write_run_config(tmp_path / f"{recomputed}.yaml", model, data, out,
                                  **sections_with(model={"activation_checkpointing": recomputed}))
        assert main.main(["--config", str(config), "--phase", "1", *NATIVE]) == 0
        outs[recomputed] = out
    assert_runs_equal(outs["full"], outs[False], [1])
    assert_runs_equal(outs["selective"], outs[False], [1])
    eager = metric_records(outs[False])
    assert eager[-1]["loss"] < eager[0]["loss"]


def train_process(config: Path, backend: str, *args: str) -> subprocess.Popen:
    """main.py's phase 1 in a process of its own; on the native runtime, one where importing
    torch_xla is refused (and every attempt printed)."""
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    command = ([sys.executable, "-c", BLOCK_TORCH_XLA] if backend == "native"
               else [sys.executable]) + ["finetuning_pipeline/main.py", "--config", str(config), "--phase", "1", *args]
    if backend == "native":
        command += NATIVE
    else:
        env["PJRT_DEVICE"] = "CPU"
    return subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"})


def stop_after_step(proc: subprocess.Popen, out: Path, step: int) -> int:
    """SIGTERM once `step` is logged; returns the step the run stopped after (it checkpoints it)."""
    wait_for_step([proc], out, step, timeout=240, output=lambda: proc.stdout.read())
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "IMPORTED torch_xla" not in output, output
    stopped = metric_records(out)[-1]["step"]
    assert stopped < STEPS and f"stopped after step {stopped}" in output, output
    return stopped


STEPS = 10


@pytest.mark.native
def test_a_native_run_stopped_by_sigterm_resumes_bitwise_and_never_imports_torch_xla(tiny_model_dir, data, tmp_path):
    """The uninterrupted native run, and one stopped by SIGTERM after step 3 and resumed (each in
    a process where torch_xla cannot be imported): the same losses and adapter, bitwise, with
    the model's own dropout in recomputed layers and LoRA dropout drawing the same masks."""
    model = with_attention_dropout(tiny_model_dir, tmp_path)  # (its masks must be drawn again alike)
    sections = sections_with(train={"max_steps": STEPS}, checkpoint={"every": 4, "keep": 2},
                             model={"activation_checkpointing": True})
    reference = write_run_config(tmp_path / "reference.yaml", model, data, tmp_path / "reference", **sections)
    proc = train_process(reference, "native")
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "IMPORTED torch_xla" not in output, output

    config = write_run_config(tmp_path / "run.yaml", model, data, tmp_path / "out", **sections)
    stopped = stop_after_step(train_process(config, "native"), tmp_path / "out", 3)
    proc = train_process(config, "native")  # --resume auto
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "IMPORTED torch_xla" not in output, output
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == stopped
    assert_same_run(tmp_path / "out", tmp_path / "reference")


@pytest.mark.parametrize("first,then", [("xla", "native"), ("native", "xla")])
def test_a_checkpoint_of_one_runtime_resumes_in_the_other(first, then, tiny_model_dir, data, tmp_path):
    """A checkpoint holds host tensors and each step draws from its own seeds, so a run stopped
    by SIGTERM under one runtime and resumed under the other equals the uninterrupted run of the
    first (float64): nothing of the runtime is a resume key."""
    sections = sections_with(train={"max_steps": STEPS})
    reference = write_run_config(tmp_path / "reference.yaml", tiny_model_dir, data, tmp_path / "reference",
                                 **sections)
    assert main.main(["--config", str(reference), "--phase", "1", *(NATIVE if first == "native" else [])]) == 0
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **sections)
    stopped = stop_after_step(train_process(config, first), tmp_path / "out", 3)
    assert main.main(["--config", str(config), "--phase", "1", *(NATIVE if then == "native" else [])]) == 0
    summary = json.loads((tmp_path / "out" / "phase1" / "summary.json").read_text())
    assert summary["runtime"] == then and summary["resumed_from_step"] == stopped
    assert_runs_equal(tmp_path / "out", tmp_path / "reference", [1])


@pytest.mark.native
@pytest.mark.parametrize("phase_data", ["text", "pairs"])
def test_compiled_layers_train_as_eager_does_and_compile_only_in_warm_up(phase_data, tiny_model_dir, data, tmp_path):
    """runtime.compile=layers: each decoder layer under torch.compile (LoRA dropout, the shared A
    products and a q8_0 base's dequantizing matmul inside it), in fp32 (float64 proofs run
    eagerly: a compiled layer does not keep float64 throughout, and the config refuses it).
    Step 1's loss is one forward of the same weights: within fp32's bound of eager's; the later
    steps' follow it closely; and after the warm-up step dynamo compiles nothing: evaluations
    between steps reuse their graphs too. On pairs (a DPO phase, its reference the base): the
    reference's forward goes through the same compiled layers with every row routed past the
    adapter (a guarded attribute: graphs of their own, compiled in the warm-up), and step 1's loss
    is ln 2 within the same bound."""
    from tolerances import fp32_forward_bound
    from transformers import AutoConfig

    sections = sections_with(train={"max_steps": 4}, model={"dtype": "float32", "quantize": "q8_0"},
                             **({"phase1": {"data": str(data["pairs"])}} if phase_data == "pairs" else {}))
    outs = {}
    for compiled in ("eager", "layers"):
        out = tmp_path / compiled
        config = write_run_config(tmp_path / f"{compiled}.yaml", tiny_model_dir, data, out, **sections)
        assert main.main(["--config", str(config), "--phase", "1", *NATIVE, f"runtime.compile={compiled}"]) == 0
        outs[compiled] = out
    eager, compiled = (metric_records(outs[k]) for k in ("eager", "layers"))
    assert [r["step"] for r in eager] == [r["step"] for r in compiled] == [1, 2, 3, 4]
    bound = fp32_forward_bound(eager[0]["loss"], AutoConfig.from_pretrained(tiny_model_dir))
    assert abs(eager[0]["loss"] - compiled[0]["loss"]) <= bound
    if phase_data == "pairs":
        assert abs(compiled[0]["loss"] - math.log(2)) <= bound and compiled[-1]["rewards/margins"] != 0.0
    assert all(abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]) for a, b in zip(eager, compiled))
    summary = json.loads((outs["layers"] / "phase1" / "summary.json").read_text())
    assert summary["compiles_total"] >= 1 and summary["compiles_after_warmup"] == 0
    assert summary["host_syncs_per_step"] == 0  # step 2's (step 1's compiles make some of their own)
    assert json.loads((outs["eager"] / "phase1" / "summary.json").read_text())["compiles_total"] == 0


@pytest.mark.native
def test_a_bf16_base_trains_within_bf16s_rounding_of_fp32(tiny_model_dir, data, tmp_path):
    """The native runtime on a bf16 base (what a GPU or TorchTPU runs), fp32 LoRA weights and
    optimizer under it: each step's loss within bf16's bound of the fp32 run's, and the adapter
    saved in fp32."""
    from trainer_helpers import adapter_tensors

    outs = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        config = write_run_config(tmp_path / f"{dtype}.yaml", tiny_model_dir, data, out,
                                  **sections_with(model={"dtype": dtype}, train={"max_steps": 8}))
        assert main.main(["--config", str(config), "--phase", "1", *NATIVE]) == 0
        outs[dtype] = out
    bf16, fp32 = metric_records(outs["bfloat16"]), metric_records(outs["float32"])
    assert [r["step"] for r in bf16] == [r["step"] for r in fp32] == list(range(1, 9))
    assert_within_bf16_rounding([r["loss"] for r in bf16], fp32)
    assert {t.dtype for t in adapter_tensors(outs["bfloat16"]).values()} == {torch.float32}
