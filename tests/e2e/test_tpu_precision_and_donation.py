"""The TPU's own numerics rehearsed on XLA:CPU: bf16 base weights (LoRA weights, AdamW moments and
the loss stay fp32) with buffer donation on (XLA_ENABLE_PARAM_ALIASING=1, torch_xla's default on
a TPU; every other CPU test turns it off for host speed), through the hard cases: the captured
step with scanned layers and the chunked loss, a resume, fsdp on four devices, two
sliding-window families, a curriculum's merge and continue, and adapters side by side.

Each TPU-path run is a process of its own (aliasing is read when torch_xla starts, and this
process runs with it off) under train.recompile_policy=error: a graph compiled after warm-up
exits 3, a tensor left holding a donated buffer fails the run ("buffer deleted"). Each is
compared with the same run in fp32 without donation, in this process.

Tolerance: every step's train loss within tests/tolerances.bf16_loss_bound of fp32's, derived
from bf16's unit roundoff, the step's label tokens and the step's number (1.2e-3 at step 1 to
9.7e-3 at step 8 for 512 tokens on losses of about 7, an untrained tiny model)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from model_families import FAMILIES
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic, assert_within_bf16_rounding, bf16_loss_bound
from trainer_helpers import adapter_tensors, metric_records, train_in_fresh_process, train_losses, write_run_config

from finetuning_pipeline import main

TPU_PATH = {"XLA_ENABLE_PARAM_ALIASING": "1"}
RUN = {"train": {"max_steps": 8, "micro_batch": 4, "grad_accum": 2, "loss_chunk_tokens": 50, "scan_layers": True,
                 "recompile_policy": "error"},
       "checkpoint": {"every": 4, "keep": 3}, "eval": {"every": 4, "max_batches": 2},
       "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}
CHIPS = 4


def write_config(root, model_dir, data, name: str, dtype: str, **changes):
    sections = {k: dict(v) for k, v in RUN.items()}
    for section, values in changes.items():
        sections.setdefault(section, {}).update(values)
    sections["model"] = {**sections.get("model", {}), "dtype": dtype}
    return write_run_config(root / f"{name}_{dtype}.yaml", model_dir, data, root / f"{name}_{dtype}", **sections)


def train_on_tpu_path(config, *args, env=None):
    proc = train_in_fresh_process(config, "--phase", "1", *args, env={**TPU_PATH, **(env or {})})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def summary(out) -> dict:
    return json.loads((out / "phase1" / "summary.json").read_text())


def assert_tpu_path_run(out, reference) -> None:
    """No graph after warm-up, no host sync, every state tensor the step updates donated, fp32
    LoRA weights, and the fp32 run's losses within bf16's bound at every step."""
    ran = summary(out)
    assert ran["compiles_after_warmup"] == 0 and ran["host_syncs_per_step"] == 0
    assert ran["step_updated_state_tensors"] > 0
    assert ran["step_donated_buffers"] == ran["step_updated_state_tensors"], ran
    assert {t.dtype for t in adapter_tensors(out).values()} == {torch.float32}
    ours, theirs = metric_records(out), metric_records(reference)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, 9))
    assert_within_bf16_rounding([r["loss"] for r in ours], theirs)
    assert ours[-1]["loss"] < ours[0]["loss"]


def family_model_dir(tiny_model_dir, root, family: str):
    """The tiny model's tokenizer with a tiny model of `family` (its window, soft-caps, layer
    types) at the tokenizer's vocabulary."""
    from transformers import AutoModelForCausalLM

    model_dir = root / family
    shutil.copytree(tiny_model_dir, model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    config = FAMILIES[family]()
    config.vocab_size, config.pad_token_id, config.max_position_embeddings = vocab, 0, 256
    torch.manual_seed(0)
    for name in ("model.safetensors", "config.json"):
        (model_dir / name).unlink(missing_ok=True)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    return model_dir


@pytest.fixture(scope="module")
def runs(tiny_model_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("tpu_path")
    assert main.main(["--config", str(write_config(root, tiny_model_dir, data, "captured", "float32")),
                      "--phase", "1"]) == 0
    train_on_tpu_path(write_config(root, tiny_model_dir, data, "captured", "bfloat16"))
    return root


def test_the_captured_scanned_chunked_step_in_bf16_with_donation(runs):
    assert_tpu_path_run(runs / "captured_bfloat16", runs / "captured_float32")
    ran = summary(runs / "captured_bfloat16")
    assert ran["scanned_layers"] is True


def test_a_bf16_run_with_donation_resumes_bitwise(runs, tiny_model_dir, data, tmp_path):
    """From its step-4 checkpoint into a fresh output_dir: the resume copies run with donation on
    (a copy left holding a donated buffer would fail the step after), the same losses and adapter."""
    config = write_config(tmp_path, tiny_model_dir, data, "captured", "bfloat16")
    checkpoint = tmp_path / "captured_bfloat16" / "phase1" / "checkpoints" / "step_00000004"
    shutil.copytree(runs / "captured_bfloat16" / "phase1" / "checkpoints" / checkpoint.name, checkpoint)
    train_on_tpu_path(config, "--resume", str(checkpoint))
    out, reference = tmp_path / "captured_bfloat16", runs / "captured_bfloat16"
    assert train_losses(out)[-4:] == [r for r in train_losses(reference) if r[0] > 4]
    finished, ours = adapter_tensors(reference), adapter_tensors(out)
    assert ours.keys() == finished.keys()
    for key, value in ours.items():
        assert torch.equal(value, finished[key]), key


def test_fsdp_on_four_devices_in_bf16_with_donation(runs, tiny_model_dir, data):
    """The same global batch (micro-batch 1 on each of 4 chips; fsdp does not scan layers): the dp fp32
    run's losses."""
    config = write_config(runs, tiny_model_dir, data, "fsdp", "bfloat16", parallel={"mode": "fsdp"},
                          train={"micro_batch": 1, "scan_layers": None}, eval={"micro_batch": 1})
    train_on_tpu_path(config, env={"CPU_NUM_DEVICES": str(CHIPS)})
    assert summary(runs / "fsdp_bfloat16")["parallel"]["sharded_base_parameters"] > 0
    assert_tpu_path_run(runs / "fsdp_bfloat16", runs / "captured_float32")


@pytest.mark.parametrize("family", ["gemma2", "mistral"])
def test_sliding_window_families_in_bf16_with_donation(family, tiny_model_dir, data, tmp_path):
    """Gemma 2 (a window on every other layer, attention and final soft-caps: a mask per layer
    type) and Mistral with a window on every layer (one windowed mask)."""
    model_dir = family_model_dir(tiny_model_dir, tmp_path, family)
    changes = {"model": {"path": str(model_dir)}, "train": {"scan_layers": None}}  # scanned where allowed
    reference = write_config(tmp_path, model_dir, data, family, "float32", **changes)
    assert main.main(["--config", str(reference), "--phase", "1"]) == 0
    train_on_tpu_path(write_config(tmp_path, model_dir, data, family, "bfloat16", **changes))
    assert_tpu_path_run(tmp_path / f"{family}_bfloat16", tmp_path / f"{family}_float32")


def test_a_curriculum_merges_and_continues_in_bf16_with_donation(tiny_model_dir, data, tmp_path):
    """Later phases on the TPU path: phase 2 merges phase 1's fp32 adapter into the bf16 base and
    phase 3 continues phase 2's, every phase captured and scanned with donation on. Each starts
    where the one before ended, up to the bf16 rounding of the merged weights, and compiles
    nothing: a merge changes the base's values, not the graph, so phases 2 and 3 replay phase
    1's step (whose donation is checked) and report no donation of their own (None)."""
    config = write_config(tmp_path, tiny_model_dir, data, "curriculum", "bfloat16",
                          train={"max_steps": 3}, eval={"every": 0, "max_batches": 2},
                          phase2={"data": str(data[2]), "init": "merge"},
                          phase3={"data": str(data[2]), "init": "continue"},
                          phase1={"data": str(data[2])})
    proc = train_in_fresh_process(config, env=TPU_PATH)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "curriculum_bfloat16"
    s = {n: json.loads((out / f"phase{n}" / "summary.json").read_text()) for n in (1, 2, 3)}
    for n, ran in s.items():
        assert ran["compiles_after_warmup"] == 0 and ran["host_syncs_per_step"] == 0, n
        assert {t.dtype for t in adapter_tensors(out, n).values()} == {torch.float32}, n
    assert s[1]["step_donated_buffers"] == s[1]["step_updated_state_tensors"] > 0, s[1]
    assert [(s[n]["compiles_total"], s[n]["step_donated_buffers"]) for n in (2, 3)] == [(0, None)] * 2
    # Continued: the same weights and graph, so the same loss. Merged: each W0 + s B A rounded
    # once to bf16, which moves the eval loss by bf16's bound for one step over its label tokens.
    assert s[3]["eval_loss_before"] == s[2]["eval_loss_after"]
    eval_tokens = [r for r in metric_records(out, "eval", 1) if r["step"] == s[1]["steps"]][0]["label_tokens"]
    bound = bf16_loss_bound(s[1]["eval_loss_after"], eval_tokens, step=1)
    assert_equal_in_exact_arithmetic(s[2]["eval_loss_before"], s[1]["eval_loss_after"], "merged phase's start", bound)


def test_adapters_side_by_side_in_bf16_with_donation(tiny_model_dir, data, tmp_path):
    """Two adapters side by side (raw text and chat, their own lr) on the TPU path: captured,
    scanned, the chunked loss; every per-adapter state tensor (step counts, flags, counters)
    donated, nothing compiled after warm-up, each adapter's losses within bf16's bound of the
    same run in fp32, and each written in fp32."""
    adapters = {"text": {"data": str(data[1])}, "chat": {"data": str(data[2]), "lr": 5e-3}}
    changes = {"phase1": {"data": "", "adapters": adapters}, "phase2": {"data": "", "init": "fresh"}}
    reference = write_config(tmp_path, tiny_model_dir, data, "side_by_side", "float32", **changes)
    assert main.main(["--config", str(reference), "--phase", "1"]) == 0
    train_on_tpu_path(write_config(tmp_path, tiny_model_dir, data, "side_by_side", "bfloat16", **changes))
    out, fp32 = tmp_path / "side_by_side_bfloat16", tmp_path / "side_by_side_float32"
    ran = summary(out)
    assert ran["compiles_after_warmup"] == 0 and ran["host_syncs_per_step"] == 0 and ran["scanned_layers"]
    assert ran["step_donated_buffers"] == ran["step_updated_state_tensors"] > 0, ran
    for name in adapters:
        ours, theirs = ([r["adapters"][name] for r in metric_records(run)] for run in (out, fp32))
        assert len(ours) == len(theirs) == 8
        assert_within_bf16_rounding([r["loss"] for r in ours], theirs, name)
        written = load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
        assert {t.dtype for t in written.values()} == {torch.float32}, name
