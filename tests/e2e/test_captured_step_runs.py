"""The trainer with its step captured (train.capture_step) against the same run traced every
step, and the runs whose step cannot be captured (dropout in the model under activation
checkpointing): traced every step, saying so. The captured step's own pieces are tested in
tests/finetuning_pipeline/train/test_step_capture.py."""

from __future__ import annotations

import json

import torch
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import write_run_config

from finetuning_pipeline import main


def train_losses(out) -> dict[int, float]:
    records = [json.loads(line) for line in (out / "phase1" / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_a_captured_run_equals_the_run_traced_every_step(tiny_model_dir, data, tmp_path):
    """20 steps, 2 micro-batches a step, LoRA dropout 0.1, recomputed (checkpointed) layers: the
    same loss at every step (the same dropout masks: each micro-batch's seed is data in both) and
    the same adapter. One graph for the step against a graph per micro-batch: XLA fuses them
    apart, equal in exact arithmetic, so in float64 (tests/tolerances.py)."""
    from safetensors.torch import load_file

    outs = {}
    for capture in (True, False):
        out = tmp_path / f"capture_{capture}"
        config = write_run_config(tmp_path / f"{capture}.yaml", tiny_model_dir, data, out,
                                  train={"max_steps": 20, "grad_accum": 2, "capture_step": capture},
                                  model={"activation_checkpointing": True, "dtype": "float64"},
                                  lora={"r": 8, "alpha": 16, "dropout": 0.1},
                                  logging={"every": 1, "progress_bar": False, "tensorboard": False},
                                  checkpoint={"every": 0, "keep": 1}, eval={"every": 0, "max_batches": 1})
        assert main.main(["--config", str(config), "--phase", "1"]) == 0
        outs[capture] = out
    captured, traced = train_losses(outs[True]), train_losses(outs[False])
    assert sorted(captured) == sorted(traced) == list(range(1, 21))
    assert_equal_in_exact_arithmetic([captured[s] for s in captured], [traced[s] for s in captured], "losses")
    assert captured[20] < captured[1]
    adapters = [load_file(out / "phase1" / "adapter" / "adapter_model.safetensors") for out in outs.values()]
    assert adapters[0].keys() == adapters[1].keys()
    for name, tensor in adapters[0].items():
        assert_equal_in_exact_arithmetic(tensor, adapters[1][name], name)
    summary = json.loads((outs[True] / "phase1" / "summary.json").read_text())
    assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0
    assert summary["compiles_total"] <= 3  # the step and the eval batch (a third allowed, as before)


def assert_trains_traced_with_checkpointing(model_dir, data, tmp_path, capsys, dropouts: str, **sections) -> None:
    """3 steps of phase 1 with activation checkpointing: traced every step, saying so, and trained."""
    run = write_run_config(tmp_path / "run.yaml", model_dir, data, tmp_path / "out",
                           train={"max_steps": 3, "grad_accum": 2}, model={"activation_checkpointing": True},
                           logging={"every": 1, "progress_bar": False, "tensorboard": False},
                           checkpoint={"every": 0, "keep": 1}, eval={"every": 0, "max_batches": 1}, **sections)
    assert main.main(["--config", str(run), "--phase", "1"]) == 0
    assert f"the step is traced every time: dropout in the model ({dropouts}) with activation checkpointing" \
        in capsys.readouterr().out
    assert sorted(train_losses(tmp_path / "out")) == [1, 2, 3]


def test_attention_dropout_with_checkpointing_trains_traced_every_step(tiny_model_dir, data, tmp_path, capsys):
    """The one setting the captured step cannot replay falls back to tracing every step, says
    so, and trains."""
    import shutil

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    assert_trains_traced_with_checkpointing(model_dir, data, tmp_path, capsys, "attention_dropout 0.1")


def test_residual_dropout_with_checkpointing_trains_traced_every_step(tiny_model_dir, data, tmp_path, capsys):
    """The hard case of the fallback: a family whose layers draw dropout under another name
    (Phi-3's resid_pdrop), not attention_dropout. The same fallback, not a refused capture."""
    import shutil

    from transformers import Phi3Config, Phi3ForCausalLM

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    mistral = json.loads((model_dir / "config.json").read_text())
    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(vocab_size=mistral["vocab_size"], hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=256, resid_pdrop=0.1, pad_token_id=0)).save_pretrained(model_dir)
    assert_trains_traced_with_checkpointing(
        model_dir,
        data,
        tmp_path,
        capsys,
        "resid_pdrop 0.1",
        lora={"target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
    )
