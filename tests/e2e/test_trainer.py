"""The trainer end to end on XLA:CPU, plus the pieces whose correctness it rests on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tolerances import assert_equal_in_exact_arithmetic, fp32_forward_bound
from trainer_helpers import train_in_fresh_process, write_run_config
from transformers import AutoConfig, AutoModelForCausalLM

from finetuning_pipeline import main
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.exporters.merged import export_merged
from finetuning_pipeline.generate import generate
from finetuning_pipeline.run_config import load_config
from finetuning_pipeline.train.lr_schedule import lr_at
from lora_logic.adapter_io import load_adapters


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, data, tmp_path_factory):
    """Both phases of a small run, trained once for the tests below."""
    root = tmp_path_factory.mktemp("run")
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", train={"micro_batch": 5})
    # A process of its own: the compiles its summary counts cannot be graphs another test cached.
    done = train_in_fresh_process(config)
    assert done.returncode == 0, done.stdout + done.stderr
    return root / "out", config


def test_every_output_of_both_phases(finished_run):
    out, config_path = finished_run
    config = load_config(config_path)
    assert (out / "loss.png").stat().st_size > 10_000
    for phase in (1, 2):
        phase_dir = out / f"phase{phase}"
        assert sorted(p.name for p in (phase_dir / "adapter").iterdir()) == [
            "adapter_config.json",
            "adapter_model.safetensors",
            "lineage.json",  # what it was trained on (model/lineage.py)
        ]
        lineage = json.loads((phase_dir / "adapter" / "lineage.json").read_text())
        assert lineage["base"]["name"] == config.model.path and lineage["merged_adapters"] == []
        checkpoints = sorted(p.name for p in (phase_dir / "checkpoints").iterdir())
        assert checkpoints == ["step_00000008", "step_00000012"]  # every 4, keep 2, final included
        assert all((phase_dir / "checkpoints" / c / "COMPLETE").is_file() for c in checkpoints)
        assert any((phase_dir / "tb").iterdir())
        records = [json.loads(line) for line in (phase_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 6, 12]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1, 3, 6, 9, 12]
        assert all(math.isfinite(r["loss"]) for r in records if r["kind"] == "train")
        # The rate each step used (read back from the device) is the schedule's, step for step.
        schedule = dict(peak=config.lr(phase), warmup_steps=config.train.warmup_steps,
                        total_steps=config.max_steps(phase), min_lr_ratio=config.train.min_lr_ratio)
        assert [r["lr"] for r in records if r["kind"] == "train"] == pytest.approx(
            [lr_at(r["step"] - 1, **schedule) for r in records if r["kind"] == "train"], rel=1e-6)


def test_eval_loss_drops_and_no_step_compiles_or_syncs_after_warmup(finished_run):
    out, _ = finished_run
    for phase in (1, 2):
        summary = json.loads((out / f"phase{phase}" / "summary.json").read_text())
        assert summary["steps"] == 12
        assert summary["eval_loss_after"] < summary["eval_loss_before"], summary
        assert summary["perplexity_after"] == pytest.approx(math.exp(summary["eval_loss_after"]))
        assert summary["compiles_after_warmup"] == 0
        assert summary["host_syncs_per_step"] == 0
        # Two graphs a phase: one training step, one eval batch (phase 2's differ from phase
        # 1's: packed conversations get a block-diagonal mask, the text stream a causal one).
        assert summary["compiles_total"] == 2
        # how its layers ran: no checkpoint, no per-layer compile (XLA compiles the whole step)
        assert summary["activation_checkpointing"] is None and summary["compiled_layers"] is False
        assert summary["tokens"] == 12 * 2 * 5 * 64
        assert summary["tokens_per_sec"] > 0
        for key in ("train_loss_first", "train_loss_last", "wall_time_s", "compiles_total", "data_wait_fraction"):
            assert summary[key] is not None, key


def test_phase2_continues_the_phase1_adapter(finished_run):
    out, _ = finished_run
    first_eval = json.loads((out / "phase2" / "metrics.jsonl").read_text().splitlines()[0])
    base_only = json.loads((out / "phase1" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_eval["kind"] == "eval" and first_eval["step"] == 0
    # Phase 2 starts from phase 1's adapter, so its first eval is not the untrained base's.
    config = json.loads((out / "phase2" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8 and base_only["loss"] != first_eval["loss"]


def test_resume_auto_skips_finished_phases(finished_run, capsys):
    out, config = finished_run
    before = (out / "phase2" / "summary.json").read_bytes()
    assert main.main(["--config", str(config)]) == 0
    printed = capsys.readouterr().out
    assert "phase 1: already finished" in printed and "phase 2: already finished" in printed
    assert (out / "phase2" / "summary.json").read_bytes() == before


def test_resume_never_refuses_to_overwrite_without_force(finished_run, capsys):
    _, config = finished_run
    assert main.main(["--config", str(config), "--resume", "never"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err


def test_export_loads_in_transformers_with_the_same_logits(finished_run, tiny_model_dir, tmp_path):
    out, _ = finished_run
    merged = export_merged(str(tiny_model_dir), [str(out / "phase2" / "adapter")], str(tmp_path / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    adapted = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    load_adapters(adapted, out / "phase2" / "adapter")
    tokens = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = adapted(tokens).logits
        # The run is fp32 (the default): each merged W0 + s B A is rounded once to fp32.
        bound = fp32_forward_bound(logits.abs().max(), plain.config, merged=True)
        assert_equal_in_exact_arithmetic(plain(tokens).logits, logits, "merged logits", bound)
    assert not any("lora" in key for key in plain.state_dict())
    # Generation from the merged export equals generation from base + adapter.
    prompt = "Care este reședința județului Cluj?"
    assert generate(str(merged), prompt, max_new_tokens=12) == generate(
        str(tiny_model_dir), prompt, adapters=[str(out / "phase2" / "adapter")], max_new_tokens=12
    )


def test_evaluate_command_matches_the_trainers_final_eval(finished_run, tiny_model_dir, data, capsys):
    out, _ = finished_run
    code = evaluate_main(["--model", str(tiny_model_dir), "--adapter", str(out / "phase1" / "adapter"),
                          "--data", str(data[1]), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    # fp32 (the run's default) on the CPU's kernels against XLA's, in other batch shapes.
    bound = fp32_forward_bound(summary["eval_loss_after"], AutoConfig.from_pretrained(tiny_model_dir))
    assert_equal_in_exact_arithmetic(result["loss"], summary["eval_loss_after"], "eval loss", bound)


def test_nothing_of_phase_1_is_alive_when_phase_2_starts(tiny_model_dir, data, tmp_path, monkeypatch):
    """With the garbage collector off, phase 1's model, optimizer, captured step and data loader
    are gone once phase 2 builds its own: on a chip that holds one copy of a 7B base, phase 2
    would otherwise need two. (A captured step bound to its owner's own methods would be a
    reference cycle; the loader's thread holds the phase data until it is closed.)"""
    import gc
    import weakref

    from finetuning_pipeline.train import phase_loop as trainer

    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out",
                              train={"max_steps": 3}, eval={"every": 0, "max_batches": 1})
    phase1, alive_at_phase2 = {}, []
    start_phase = trainer.start_phase

    def watched(config, phase, *args, **kwargs):
        if phase == 2:
            alive_at_phase2.extend(name for name, ref in phase1.items() if ref() is not None)
        p = start_phase(config, phase, *args, **kwargs)
        if phase == 1:
            phase1.update({name: weakref.ref(obj) for name, obj in [
                ("model", p.model), ("optimizer", p.optimizer), ("stepper", p.stepper), ("data", p.data),
                ("captured gradients", p.stepper.execution.gradients),
                ("captured update", p.stepper.execution.update)]})
        return p

    monkeypatch.setattr(trainer, "start_phase", watched)
    gc.disable()
    try:
        assert main.main(["--config", str(config)]) == 0
    finally:
        gc.enable()
    assert len(phase1) == 6 and alive_at_phase2 == []


def test_recompile_guard_stops_the_run(data, tiny_model_dir, tmp_path):
    """With no warm-up allowed, the first step's compile must trip the guard (exit 3), in a
    fresh process whose graph cache is empty."""
    config = write_run_config(tmp_path / "r.yaml", tiny_model_dir, data, tmp_path / "o",
                              train={"max_steps": 3, "warmup_compiles_steps": 0})
    done = train_in_fresh_process(config, "--phase", "1")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "new XLA graph(s) compiled after warm-up" in done.stderr and "PT_XLA_DEBUG_LEVEL=2" in done.stderr
