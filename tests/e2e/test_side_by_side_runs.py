"""Adapters trained side by side, end to end on XLA:CPU: two adapters, each with its own data
(raw text and chat), learning rate and number of steps, in one run over one frozen base. Each
one's per-step losses, evaluations and final weights equal a run of it alone with the same
seeds, in float64 within 1e-10 (tests/tolerances.py): on one device (LoRA dropout on, chunked
loss, captured step), with the layers scanned and recomputed, on two replica threads of the
TPU launcher (the step traced every time), and under fsdp on four SPMD devices with activation
checkpointing. A resumed run resumes both bitwise; an adapter that diverges stops alone and the
other trains on as if alone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import LaunchedRun, metric_records, poison_nan_in_steps, train_in_fresh_process, write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main

# Each adapter's own settings; its data is the fixture's data[phase].
ADAPTERS = {"text": {"phase": 1, "lr": 1e-2, "max_steps": 4}, "chat": {"phase": 2, "lr": 5e-3, "max_steps": 3}}
RUN = {"eval": {"every": 2, "max_batches": None}, "checkpoint": {"every": 2, "keep": 3},
       "logging": {"every": 1, "progress_bar": False, "tensorboard": True}, "phase2": {"init": "fresh", "data": ""}}


def sections(micro_batch: int, dropout: float, **train) -> dict:
    """Global batch 8 a step (micro_batch x replicas x 2 accumulated); a 48-token loss chunk
    leaves a ragged last chunk of each adapter's 256 tokens. In float64: side by side and alone
    are equal in exact arithmetic, not in rounding."""
    return {**RUN, "lora": {"dropout": dropout}, "model": {"dtype": "float64"},
            "train": {"micro_batch": micro_batch, "grad_accum": 2, "loss_chunk_tokens": 48, **train},
            "eval": {**RUN["eval"], "micro_batch": micro_batch}}


def side_by_side_config(root: Path, model_dir, data, name: str, micro_batch: int = 4, dropout: float = 0.1,
                        **extra) -> Path:
    adapters = {n: {"data": str(data[a["phase"]]), "lr": a["lr"], "max_steps": a["max_steps"]}
                for n, a in ADAPTERS.items()}
    return write_run_config(root / f"{name}.yaml", model_dir, data, root / name,
                            **{**sections(micro_batch, dropout), **extra},
                            phase1={"data": "", "adapters": adapters})


def train_alone(root: Path, model, data, dropout: float) -> Path:
    """Each adapter trained alone on one device."""
    for name, a in ADAPTERS.items():
        config = write_run_config(root / f"{name}.yaml", model, data, root / name, **sections(4, dropout),
                                  phase1={"data": str(data[a["phase"]]), "lr": a["lr"], "max_steps": a["max_steps"]})
        assert main.main(["--config", str(config), "--phase", "1"]) == 0
    return root


@pytest.fixture(scope="module")
def alone(tiny_model_dir, data, tmp_path_factory):
    """With LoRA dropout: its masks follow each adapter's rows, the same side by side."""
    return train_alone(tmp_path_factory.mktemp("alone"), tiny_model_dir, data, dropout=0.1)


@pytest.fixture(scope="module")
def alone_without_dropout(tiny_model_dir, data, tmp_path_factory):
    """Without: dropout masks are drawn per replica's rows, so two replicas' differ from one's."""
    return train_alone(tmp_path_factory.mktemp("alone_without_dropout"), tiny_model_dir, data, dropout=0.0)


def assert_each_as_alone(out: Path, alone: Path, adapters=tuple(ADAPTERS)) -> dict:
    """Every adapter's per-step loss, token count, evaluations and final weights are its run
    alone's, within float64's bound; returns the side-by-side summary."""
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    for name in adapters:
        ref = metric_records(alone / name, "train")
        ours = [r["adapters"][name] | {"step": r["step"]} for r in metric_records(out, "train")
                if name in r["adapters"]]
        assert [r["step"] for r in ours] == [r["step"] for r in ref] == list(range(1, ADAPTERS[name]["max_steps"] + 1))
        for mine, theirs in zip(ours, ref):
            assert mine["label_tokens"] == theirs["label_tokens"] and mine["lr"] == pytest.approx(theirs["lr"])
        assert_equal_in_exact_arithmetic([r["loss"] for r in ours], [r["loss"] for r in ref], f"{name} losses")
        ref_evals = [r["loss"] for r in metric_records(alone / name, "eval")]
        our_evals = [r["adapters"][name]["loss"] for r in metric_records(out, "eval")][:len(ref_evals)]
        assert_equal_in_exact_arithmetic(our_evals, ref_evals, f"{name} evaluations")
        theirs = load_file(alone / name / "phase1" / "adapter" / "adapter_model.safetensors")
        mine = load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
        assert mine.keys() == theirs.keys() and all(t.dtype == torch.float64 for t in mine.values())
        for key in mine:
            assert_equal_in_exact_arithmetic(mine[key], theirs[key], f"{name} {key}")
        reference = json.loads((alone / name / "phase1" / "summary.json").read_text())
        keys = ("train_loss_first", "train_loss_last", "eval_loss_before", "eval_loss_after", "skipped_steps")
        assert_equal_in_exact_arithmetic([summary["adapters"][name][k] for k in keys], [reference[k] for k in keys],
                                         f"{name} summary")
    return summary


@pytest.fixture(scope="module")
def together(tiny_model_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("together")
    config = side_by_side_config(root, tiny_model_dir, data, "one_device")
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    return root / "one_device", config


def test_each_adapter_trains_as_it_would_alone_on_one_device(together, alone, tiny_model_dir, data, capsys):
    out, _ = together
    summary = assert_each_as_alone(out, alone)
    assert summary["steps"] == 4 and summary["compiles_after_warmup"] == 0
    assert {n: s["steps"] for n, s in summary["adapters"].items()} == {"text": 4, "chat": 3}
    # The adapter each writes is what `evaluate` serves: its eval loss is the summary's (in
    # float64 as the run, in other batch shapes).
    for name, a in ADAPTERS.items():
        assert evaluate_main(["--model", str(tiny_model_dir), "--adapter", summary["adapters"][name]["adapter"],
                              "--data", str(data[a["phase"]]), "--dtype", "float64", "--json"]) == 0
        loss = json.loads(capsys.readouterr().out)["loss"]
        assert_equal_in_exact_arithmetic(loss, summary["adapters"][name]["eval_loss_after"], f"{name}'s eval loss")
    checkpoint = out / "phase1" / "checkpoints" / "step_00000004"
    assert sorted(p.name for p in (checkpoint / "adapters").iterdir()) == ["chat", "text"]
    assert (out / "loss.png").stat().st_size > 10_000


def test_a_resumed_run_resumes_every_adapter_bitwise(together, tmp_path):
    out, config = together
    copy = tmp_path / "resumed"
    shutil.copytree(out, copy)
    for name in ADAPTERS:
        (copy / "phase1" / "adapters" / name / "adapter_model.safetensors").unlink()
    checkpoint = copy / "phase1" / "checkpoints" / "step_00000002"
    assert main.main(["--config", str(config), "--phase", "1", f"output_dir={copy}", "--resume", str(checkpoint)]) == 0
    for name in ADAPTERS:
        resumed = load_file(copy / "phase1" / "adapters" / name / "adapter_model.safetensors")
        uninterrupted = load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
        assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted), name
    assert json.loads((copy / "phase1" / "summary.json").read_text())["resumed_from_step"] == 2


def test_a_resume_with_the_adapters_listed_in_another_order_continues_each_adapter(together, tmp_path):
    """The order of the config's adapters is not a resume key. Restored by position, each adapter
    would take the other's optimizer state and drift (loss 0.808 against 0.751 at step
    20); by name, each continues as uninterrupted. The rows' order differs, so the sums may
    round apart: held to float64's bound, as side by side against alone."""
    out, config = together
    copy = tmp_path / "reordered"
    shutil.copytree(out, copy)
    for name in ADAPTERS:
        (copy / "phase1" / "adapters" / name / "adapter_model.safetensors").unlink()
    settings = yaml.safe_load(config.read_text())
    written = list(settings["phase1"]["adapters"])
    settings["phase1"]["adapters"] = {name: settings["phase1"]["adapters"][name] for name in reversed(written)}
    reordered = tmp_path / "reordered.yaml"
    reordered.write_text(yaml.safe_dump({**settings, "output_dir": str(copy)}, sort_keys=False))
    checkpoint = copy / "phase1" / "checkpoints" / "step_00000002"
    assert main.main(["--config", str(reordered), "--phase", "1", "--resume", str(checkpoint)]) == 0
    step_3 = [r for r in metric_records(copy, "train") if r["step"] == 3][-1]  # (both adapters step)
    assert list(step_3["adapters"]) == list(reversed(written))  # the rows' order is the new one
    summary = json.loads((copy / "phase1" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["resumed_with_changes"] is None
    for name in ADAPTERS:
        resumed = load_file(copy / "phase1" / "adapters" / name / "adapter_model.safetensors")
        uninterrupted = load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
        for key in uninterrupted:
            assert_equal_in_exact_arithmetic(resumed[key], uninterrupted[key], f"reordered {name} {key}")
    for name in ADAPTERS:
        ours = [r["adapters"][name]["loss"] for r in metric_records(copy, "train") if name in r["adapters"]]
        theirs = [r["adapters"][name]["loss"] for r in metric_records(out, "train") if name in r["adapters"]]
        assert_equal_in_exact_arithmetic(ours[-1], theirs[-1], f"reordered {name} last loss")


def test_scanned_layers_with_activation_checkpointing_train_each_as_alone_and_resume_bitwise(alone, tiny_model_dir,
                                                                                           data, tmp_path):
    """The decoder layers as one XLA loop over their stacked weights (each adapter's A and B
    stacked with the base's), recomputed in the backward: each adapter is still its run alone,
    and a resume from a checkpoint (its optimizer state stored per layer) is bitwise."""
    config = side_by_side_config(tmp_path, tiny_model_dir, data, "scanned",
                                 train={"micro_batch": 4, "grad_accum": 2, "loss_chunk_tokens": 48,
                                        "scan_layers": True},
                                 model={"path": str(tiny_model_dir), "dtype": "float64",
                                        "activation_checkpointing": True})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    out = tmp_path / "scanned"
    summary = assert_each_as_alone(out, alone)
    assert summary["scanned_layers"] and summary["compiles_after_warmup"] == 0
    uninterrupted = {name: load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
                     for name in ADAPTERS}
    checkpoint = out / "phase1" / "checkpoints" / "step_00000002"
    assert main.main(["--config", str(config), "--phase", "1", "--resume", str(checkpoint)]) == 0
    assert json.loads((out / "phase1" / "summary.json").read_text())["resumed_from_step"] == 2
    for name in ADAPTERS:
        resumed = load_file(out / "phase1" / "adapters" / name / "adapter_model.safetensors")
        assert all(torch.equal(resumed[k], uninterrupted[name][k]) for k in resumed), name


def test_a_diverging_adapter_stops_alone_and_the_other_trains_on(alone, tiny_model_dir, data, tmp_path,
                                                                 monkeypatch, capsys):
    # chat's loss is NaN from step 2 on (the adapters' rows are in the YAML's order: chat, text).
    poison_nan_in_steps(monkeypatch, steps=set(range(2, 10)), grad_accum=2, group=0)
    config = side_by_side_config(tmp_path, tiny_model_dir, data, "diverging", dropout=0.1,
                                 train={"micro_batch": 4, "grad_accum": 2, "loss_chunk_tokens": 48,
                                        "max_bad_steps": 2})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    assert "adapter chat stopped at step 3: 2 consecutive steps had a non-finite loss" in capsys.readouterr().out
    summary = assert_each_as_alone(tmp_path / "diverging", alone, adapters=["text"])
    chat = summary["adapters"]["chat"]
    assert chat["diverged_at_step"] == 3 and chat["skipped_steps"] == 2
    written = load_file(tmp_path / "diverging" / "phase1" / "adapters" / "chat" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in written.values())


def test_two_replica_threads_of_the_tpu_launcher_train_each_as_alone(alone_without_dropout, tiny_model_dir, data,
                                                                     tmp_path):
    config = side_by_side_config(tmp_path, tiny_model_dir, data, "threads", micro_batch=2, dropout=0.0,
                                 train={"micro_batch": 2, "grad_accum": 2, "loss_chunk_tokens": 48,
                                        "capture_step": False})
    run = LaunchedRun(["--config", str(config), "--phase", "1"], tmp_path / "run.log", devices=2)
    assert run.wait(240) == [0], run.output()
    summary = assert_each_as_alone(tmp_path / "threads", alone_without_dropout)
    assert summary["world_size"] == 2 and summary["compiles_after_warmup"] == 0


def test_fsdp_on_four_devices_trains_each_as_alone(alone, tiny_model_dir, data, tmp_path):
    """Against the runs alone on one device: in float64 the sharded sums' other order no longer
    moves the weights (in fp32, Adam's division by sqrt(v) raised it to ~1e-5 after 4 steps)."""
    fsdp = {"parallel": {"mode": "fsdp"},
            "model": {"path": str(tiny_model_dir), "dtype": "float64", "activation_checkpointing": True}}
    config = side_by_side_config(tmp_path, tiny_model_dir, data, "fsdp", micro_batch=1, dropout=0.1, **fsdp)
    proc = train_in_fresh_process(config, "--phase", "1", env={"CPU_NUM_DEVICES": "4"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = assert_each_as_alone(tmp_path / "fsdp", alone)
    assert summary["parallel"]["mode"] == "fsdp" and summary["compiles_after_warmup"] == 0
