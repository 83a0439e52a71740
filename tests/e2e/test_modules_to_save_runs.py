"""A new language's phase 1: the embeddings and the output layer trained in full beside the LoRA
(lora.modules_to_save, train.embedding_lr), end to end on XLA:CPU in float64: phase 1, then
phase 2 continuing the same adapter (its modules trained further), shared by the tests below.

Claims: the step with the modules is one captured graph (no compile after warm-up, no host
sync); the adapter on disk is in PEFT's layout with the modules' weights, which moved from the
base's (at train.embedding_lr, the LoRA at train.lr); a run resumed from a checkpoint is the
uninterrupted one bitwise (the modules' AdamW moments included); the merged export is a plain
model whose logits are the adapter's."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import adapter_tensors, train_losses, write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.exporters.merged import export_merged
from finetuning_pipeline.model.loading import load_model
from finetuning_pipeline.run.checkpointing import complete_checkpoints

SAVED = ["embed_tokens", "lm_head"]
SECTIONS = {"model": {"dtype": "float64"}, "lora": {"r": 8, "alpha": 16, "modules_to_save": SAVED},
            "train": {"max_steps": 6, "embedding_lr": 2e-3}, "eval": {"every": 3, "max_batches": 2},
            "checkpoint": {"every": 3, "keep": 2}, "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}


@pytest.fixture(scope="module")
def run(tiny_model_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("modules_to_save")
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", **SECTIONS)
    assert main.main(["--config", str(config), "--phase", "all"]) == 0
    return {"config": config, "out": root / "out", "model": tiny_model_dir}


def test_the_modules_train_beside_the_lora_in_one_graph_and_are_saved_in_peft_layout(run):
    base = load_file(run["model"] / "model.safetensors")
    for phase in (1, 2):
        summary = json.loads((run["out"] / f"phase{phase}" / "summary.json").read_text())
        assert summary["compiles_after_warmup"] == 0 and summary["host_syncs_per_step"] == 0, summary
        config = json.loads((run["out"] / f"phase{phase}" / "adapter" / "adapter_config.json").read_text())
        assert config["modules_to_save"] == SAVED
        tensors = adapter_tensors(run["out"], phase)
        for key, base_key in (("model.embed_tokens.weight", "model.embed_tokens.weight"),
                              ("lm_head.weight", "lm_head.weight")):
            trained = tensors[f"base_model.model.{key}"]
            assert trained.shape == base[base_key].shape and not torch.equal(trained, base[base_key].to(trained.dtype))
    # Phase 2 continued them: its modules moved on from phase 1's.
    first, second = adapter_tensors(run["out"], 1), adapter_tensors(run["out"], 2)
    assert not torch.equal(first["base_model.model.lm_head.weight"], second["base_model.model.lm_head.weight"])


def test_a_resumed_run_is_the_uninterrupted_one_bitwise(run, tmp_path):
    checkpoint = complete_checkpoints(run["out"] / "phase1" / "checkpoints")[0]
    assert checkpoint.name.endswith("00000003")
    out = tmp_path / "out"
    assert main.main(["--config", str(run["config"]), "--phase", "1", f"output_dir={out}",
                      "--resume", str(checkpoint)]) == 0
    assert json.loads((out / "phase1" / "summary.json").read_text())["resumed_from_step"] == 3
    assert train_losses(out) == train_losses(run["out"])[3:]
    ours, theirs = adapter_tensors(out), adapter_tensors(run["out"])
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_the_merged_export_is_a_plain_model_with_the_adapters_logits(run, tmp_path):
    """Exported from the base stored in float64 (the run's own weights, exactly: it trained on the
    fp32 base read in float64), so the merge is float64's and the bound float64's."""
    import shutil

    from transformers import AutoModelForCausalLM

    base = tmp_path / "base64"
    shutil.copytree(run["model"], base)
    AutoModelForCausalLM.from_pretrained(run["model"], dtype=torch.float64).save_pretrained(base)
    adapters = [str(run["out"] / "phase2" / "adapter")]  # (phase 2 continued phase 1's)
    ids = torch.randint(1, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    adapted, _ = load_model(base, adapters, torch.float64, keep_last=True, warn=lambda message: None)
    export_merged(str(base), adapters, str(tmp_path / "merged"), warn=lambda message: None)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64)
    assert not any(".modules_to_save." in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids, use_cache=False).logits
        assert_equal_in_exact_arithmetic(merged.eval()(input_ids=ids, use_cache=False).logits, expected,
                                         "the merged model's logits")
    assert not math.isnan(float(expected.sum()))
