"""Run safety: one run per output directory, no resume onto other data, checkpoint counters of
the step they save, and clear errors (not tracebacks) from every command."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_helpers import SEQ_LEN, poison_nan_in_steps, write_run_config

from dataset import prepare
from dataset.samples import DOMAIN_TEXT
from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.export import main as export_main
from finetuning_pipeline.generate import main as generate_main

SHORT = {"train": {"max_steps": 4}, "checkpoint": {"every": 2, "keep": 3}, "eval": {"every": 0, "max_batches": 1},
         "logging": {"every": 1, "progress_bar": False, "tensorboard": False}}


def hold_lock(output_dir: Path) -> subprocess.Popen:
    """Another process holding output_dir's lock, as a running job would."""
    code = ("import sys, time; from finetuning_pipeline.run.run_layout import OutputLock, RunLayout; "
            "OutputLock(RunLayout(sys.argv[1])).acquire(); print('locked', flush=True); time.sleep(600)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(output_dir)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def test_a_second_run_into_the_same_output_dir_is_refused_and_a_dead_holder_is_taken_over(
        tiny_model_dir, data, tmp_path, capsys):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **SHORT)
    holder = hold_lock(tmp_path / "out")
    try:
        assert main.main(["--config", str(config), "--phase", "1"]) == 2
        err = capsys.readouterr().err
        assert f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}" in err
        assert not (tmp_path / "out" / "phase1").exists()  # refused before anything was written
    finally:
        holder.kill()  # the holder dies without releasing: the kernel drops its lock
        holder.wait()
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    assert json.loads((tmp_path / "out" / ".lock").read_text())["pid"] == os.getpid()


def test_resume_is_refused_when_the_prepared_data_changed(tiny_model_dir, tmp_path, capsys):
    data_dir = tmp_path / "data1"

    def prepare_phase1(text_file: Path) -> None:
        assert prepare.main(["--tokenizer", str(tiny_model_dir), "--seq-len", str(SEQ_LEN), "--out", str(data_dir),
                             "--input", str(text_file), "--quiet", "--force"]) == 0

    prepare_phase1(DOMAIN_TEXT)
    config = write_run_config(
        tmp_path / "run.yaml", tiny_model_dir, {1: data_dir, 2: data_dir}, tmp_path / "out", **SHORT
    )
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    checkpoint = tmp_path / "out" / "phase1" / "checkpoints" / "step_00000002"
    resume = ["--config", str(config), "--phase", "1", "--resume", str(checkpoint)]

    prepare_phase1(DOMAIN_TEXT)  # the same inputs again: the same data, so resuming is fine
    assert main.main(resume) == 0
    capsys.readouterr()

    fewer = tmp_path / "fewer.jsonl"
    fewer.write_text("".join(DOMAIN_TEXT.read_text(encoding="utf-8").splitlines(keepends=True)[:100]), encoding="utf-8")
    prepare_phase1(fewer)  # other inputs into the same directory, between a stop and its resume
    assert main.main(resume) == 2
    err = capsys.readouterr().err
    assert (
        "phase1.data.content" in err and f"the prepared data in {data_dir} is not what the checkpoint trained on" in err
    )


def test_a_checkpoint_holds_the_skipped_step_count_of_the_step_it_saves(tiny_model_dir, data, tmp_path, monkeypatch):
    """Step 3 is skipped (NaN loss); the step-4 checkpoint is not a log step (logs at 1, 5, 6)."""
    poison_nan_in_steps(monkeypatch, steps={3}, grad_accum=2)
    sections = {**SHORT, "train": {"max_steps": 6, "max_bad_steps": 3}, "checkpoint": {"every": 4, "keep": 3},
                "logging": {"every": 5, "progress_bar": False, "tensorboard": False}}
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **sections)
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    state = json.loads(
        (tmp_path / "out" / "phase1" / "checkpoints" / "step_00000004" / "trainer_state.json").read_text()
    )
    assert state["step"] == 4 and state["skipped_steps"] == 1


@pytest.fixture(scope="module")
def foreign_adapter(tmp_path_factory):
    """An adapter for another model (hidden size 32, the tiny demo model has 64)."""
    from conftest import tiny_causal_lm

    from lora_logic.adapter_io import save_adapters
    from lora_logic.config import LoraConfig
    from lora_logic.inject import inject_lora

    model = tiny_causal_lm("mistral")
    inject_lora(model, LoraConfig(r=4, alpha=8))
    path = tmp_path_factory.mktemp("foreign") / "adapter"
    save_adapters(model, path, LoraConfig(r=4, alpha=8), "elsewhere")
    return path


@pytest.mark.parametrize("command", ["evaluate", "generate", "export"])
@pytest.mark.parametrize("problem", ["missing", "mismatched"])
def test_commands_report_a_bad_adapter_as_an_error_not_a_traceback(command, problem, tiny_model_dir, data,
                                                                     foreign_adapter, tmp_path, capsys):
    adapter = tmp_path / "nowhere" if problem == "missing" else foreign_adapter
    runs = {
        "evaluate": lambda: evaluate_main(["--model", str(tiny_model_dir), "--adapter", str(adapter),
                                           "--data", str(data[1]), "--samples", "0"]),
        "generate": lambda: generate_main(["--model", str(tiny_model_dir), "--adapter", str(adapter), "--prompt", "x"]),
        "export": lambda: export_main(["--base", str(tiny_model_dir), "--adapter", str(adapter),
                                       "--out", str(tmp_path / "merged")]),
    }
    assert runs[command]() == 2
    err = capsys.readouterr().err
    assert f"error: adapter {adapter}: " in err and "Traceback" not in err
    assert ("no adapter config here" if problem == "missing" else "does not fit this model") in err
    assert not (tmp_path / "merged").exists()


@pytest.mark.parametrize("damage", ["truncated weights", "garbled config"])
def test_a_damaged_adapter_is_named_by_every_command(damage, tiny_model_dir, data, foreign_adapter, tmp_path, capsys):
    adapter = tmp_path / "adapter"
    shutil.copytree(foreign_adapter, adapter)
    if damage == "truncated weights":
        weights = adapter / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (adapter / "adapter_config.json").write_text('{"r": 4, "lora_alpha": ')
    assert evaluate_main(["--model", str(tiny_model_dir), "--adapter", str(adapter), "--data", str(data[1]),
                          "--samples", "0"]) == 2
    err = capsys.readouterr().err
    assert f"error: adapter {adapter}: {adapter}/" in err and "Traceback" not in err


@pytest.mark.parametrize("command", ["train", "prepare", "evaluate", "generate", "export"])
def test_a_model_directory_without_tokenizer_files_is_named(command, tiny_model_dir, data, tmp_path, capsys):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, bare / name)
    config = write_run_config(tmp_path / "run.yaml", bare, data, tmp_path / "out", **SHORT)
    runs = {
        "train": lambda: main.main(["--config", str(config), "--phase", "1"]),
        "prepare": lambda: prepare.main(["--input", str(DOMAIN_TEXT), "--tokenizer", str(bare), "--seq-len",
                                         str(SEQ_LEN), "--out", str(tmp_path / "prepared"), "--quiet"]),
        "evaluate": lambda: evaluate_main(["--model", str(bare), "--data", str(data[1]), "--samples", "0"]),
        "generate": lambda: generate_main(["--model", str(bare), "--prompt", "x"]),
        "export": lambda: export_main(["--base", str(bare), "--adapter", str(tmp_path / "a"), "--out",
                                       str(tmp_path / "merged")]),
    }
    assert runs[command]() == 2
    err = capsys.readouterr().err
    assert f"{bare} has no tokenizer files (one of tokenizer.json, tokenizer.model" in err
    assert "sentencepiece" not in err and "Traceback" not in err


def test_a_lora_target_that_matches_nothing_is_refused_before_the_device(tiny_model_dir, data, tmp_path, capsys):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out", **SHORT,
                              lora={"target_modules": ["q_proj", "qkv_proj"]})
    assert main.main(["--config", str(config), "--phase", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: lora.target_modules: " in err and "qkv_proj" in err
    assert not (tmp_path / "out").exists()  # found by the checks, on a weightless model


@pytest.mark.parametrize("argv, message", [
    (["--micro-batch", "0"], "argument --micro-batch: must be an integer >= 1, got 0"),
    (["--micro-batch", "two"], "argument --micro-batch: expected an integer, got 'two'"),
    (["--samples", "-1"], "argument --samples: must be an integer >= 0, got -1"),
    (["--device", "xla", "--dtype", "float64"], "--dtype float64 is for the CPU's exact comparisons; a TPU"),
])
def test_evaluate_flags_outside_their_domain_are_usage_errors(argv, message, tiny_model_dir, data, capsys,
                                                              monkeypatch):
    # As on a TPU VM (PJRT_DEVICE=TPU): each is refused before anything loads, so no runtime starts here.
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(SystemExit) as exit_info:
        evaluate_main(["--model", str(tiny_model_dir), "--data", str(data[1]), *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["", "  \n"])
def test_an_empty_prompt_is_refused(tiny_model_dir, capsys, prompt):
    """`generate --prompt ""` is refused (it would exit 0 with the chat template's own tokens, "assis")."""
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--model", str(tiny_model_dir), "--prompt", prompt])
    assert exit_info.value.code == 2 and "--prompt is empty" in capsys.readouterr().err
