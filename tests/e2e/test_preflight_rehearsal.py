"""Preflight's rehearsal (checks/rehearsal.py): the real trainer on a shrunken copy of the
run's model, trained, resumed bitwise and exported, on the prepared data or the bundled samples."""

from __future__ import annotations

import yaml
from conftest import REPO
from trainer_helpers import run_preflight, write_run_config
from transformers import AutoModelForCausalLM

from finetuning_pipeline.checks.rehearsal import REHEARSAL_STEPS

MISTRAL = REPO / "finetuning_pipeline" / "configs" / "mistral7b_v6e8.yaml"


def test_rehearsal_trains_resumes_and_exports_the_shrunken_model_under_fsdp(tmp_path, tiny_model_dir, data):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              lora={"r": 8, "alpha": 16, "dropout": 0.1})
    code, report = run_preflight(tmp_path, config, "parallel.mode=fsdp", "model.activation_checkpointing=true",
                                 rehearse=True)
    rehearsal = report["checks"]["rehearsal"]
    assert code == 0 and rehearsal["status"] == "passed", rehearsal
    assert report["checks"]["data"]["status"] == "passed" and rehearsal["data"].startswith("prepared data")
    assert rehearsal["resume_bitwise_identical"] is True
    for phase in ("phase1", "phase2"):
        assert rehearsal["phases"][phase]["steps"] == REHEARSAL_STEPS
        assert rehearsal["phases"][phase]["compiles_after_warmup"] == 0
    run = yaml.safe_load((tmp_path / "out" / "preflight_rehearsal" / "rehearsal.yaml").read_text())
    assert run["parallel"]["mode"] == "fsdp" and run["model"]["activation_checkpointing"] is True
    merged = AutoModelForCausalLM.from_pretrained(rehearsal["export"])
    assert merged.config.num_hidden_layers == 2


def test_rehearsal_before_the_download_uses_the_bundled_samples(tmp_path):
    code, report = run_preflight(tmp_path, MISTRAL, "tpu.type=v5e-8", "parallel.mode=fsdp", rehearse=True)
    rehearsal = report["checks"]["rehearsal"]
    assert code == 0 and rehearsal["status"] == "passed", rehearsal
    assert rehearsal["architecture"] == "MistralForCausalLM" and rehearsal["data"].startswith("bundled samples")


def test_the_rehearsal_scans_its_two_layers_when_the_real_model_will_be_scanned(tmp_path):
    """Mistral 7B under dp is scanned (32 identical layers): so is the 2-layer rehearsal, whose
    own depth would not be, and its resume is still bitwise."""
    code, report = run_preflight(tmp_path, MISTRAL, "tpu.type=v6e-8", "parallel.mode=dp", rehearse=True)
    rehearsal = report["checks"]["rehearsal"]
    assert code == 0 and rehearsal["status"] == "passed", rehearsal
    assert report["phases"]["phase1"]["inputs"]["scanned_layers"] is True
    assert all(phase["scanned_layers"] for phase in rehearsal["phases"].values())
    assert rehearsal["resume_bitwise_identical"] is True


def test_rehearsal_of_a_native_run_takes_the_native_runtime_and_plans_its_gpus(
        tmp_path, tiny_model_dir, data, capsys):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              lora={"r": 8, "alpha": 16, "dropout": 0.1})
    code, report = run_preflight(tmp_path, config, "runtime.backend=native", rehearse=True)
    rehearsal = report["checks"]["rehearsal"]
    assert code == 0 and rehearsal["status"] == "passed" and rehearsal["resume_bitwise_identical"] is True
    assert report["runtime"] == "native"
    run = yaml.safe_load((tmp_path / "out" / "preflight_rehearsal" / "rehearsal.yaml").read_text())
    assert run["runtime"]["backend"] == "native"
    assert report["target"] == "gpu" and report["device_type"] == "h100-80gb x1"  # gpu's defaults
    printed = capsys.readouterr().out
    assert "runtime: native on gpu.type: memory is the allocator's peak" in printed
    assert "passed  rehearsal: the native runtime on this CPU, " in printed
