"""The trainer end to end on XLA:CPU, plus the pieces whose correctness it rests on."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import tiny_causal_lm
from finetuning_pipeline import main
from finetuning_pipeline.config import load_config
from finetuning_pipeline.evaluate import main as evaluate_main
from finetuning_pipeline.export import export_merged
from finetuning_pipeline.generate import generate
from finetuning_pipeline.lr_schedule import lr_at
from finetuning_pipeline.attention_masks import allowed_positions, as_attention_mask
from finetuning_pipeline.step import train_step
from lora_logic import LoraConfig, inject_lora, load_adapter, lora_modules, lora_parameters
from trainer_helpers import prepare_demo_data, write_run_config


@pytest.fixture(scope="module")
def data(tiny_model_dir, tmp_path_factory):
    return prepare_demo_data(tiny_model_dir, tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, data, tmp_path_factory):
    """Both phases of a small run, trained once for the tests below."""
    root = tmp_path_factory.mktemp("run")
    # micro_batch 5: shapes no other test uses, so graphs cached in this process cannot hide a new one.
    config = write_run_config(root / "run.yaml", tiny_model_dir, data, root / "out", train={"micro_batch": 5})
    assert main.main(["--config", str(config)]) == 0
    return root / "out", config


def test_every_output_of_both_phases(finished_run):
    out, config_path = finished_run
    config = load_config(config_path)
    assert (out / "loss.png").stat().st_size > 10_000
    for phase in (1, 2):
        phase_dir = out / f"phase{phase}"
        assert sorted(p.name for p in (phase_dir / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
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
    load_adapter(adapted, out / "phase2" / "adapter")
    tokens = torch.randint(0, 1000, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, adapted(tokens).logits, rtol=0, atol=1e-5)
    assert not any("lora" in key for key in plain.state_dict())
    # Generation from the merged export equals generation from base + adapter.
    prompt = "Care este reședința județului Cluj?"
    assert generate(str(merged), prompt, max_new_tokens=12) == generate(
        str(tiny_model_dir), prompt, adapter=str(out / "phase2" / "adapter"), max_new_tokens=12
    )


def test_evaluate_command_matches_the_trainers_final_eval(finished_run, tiny_model_dir, data, capsys):
    out, _ = finished_run
    code = evaluate_main(["--model", str(tiny_model_dir), "--adapter", str(out / "phase1" / "adapter"),
                          "--data", str(data[1]), "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert result["loss"] == pytest.approx(summary["eval_loss_after"], abs=1e-4)


def test_lr_schedule():
    kw = dict(peak=1e-3, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    lrs = [lr_at(s, **kw) for s in range(20)]
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])  # linear, never starting at 0
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))  # then non-increasing
    assert lrs[-1] == pytest.approx(1e-4)  # the cosine ends at peak * min_lr_ratio
    assert lrs[11] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * 8 / 16)))
    assert all(lr > 0 for lr in lrs)


def test_block_causal_mask_keeps_packed_segments_apart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    mask = allowed_positions(6, "cpu", None, positions)[0, 0]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask, expected)
    additive = as_attention_mask(allowed_positions(6, "cpu", None, positions), torch.float32, sdpa=False)[0, 0]
    assert torch.equal(additive == 0, expected)


class RecordGradients:
    """Stands in for the optimizer: keeps the gradients train_step hands it (averaged, clipped)."""

    def __init__(self, params):
        self.params = params
        self.grads = None
        self.applied = None

    def flat_grad(self):
        return torch.cat([p.grad.reshape(-1) for p in self.params])

    def step(self, applied, grad):
        self.grads = [chunk.view(p.shape) for chunk, p in zip(torch.split(grad, [p.numel() for p in self.params]),
                                                              self.params)]
        self.applied = applied

    def zero_grad(self):
        for p in self.params:
            p.grad.zero_()


def test_gradient_accumulation_equals_one_large_batch():
    """2 micro-batches of 2 give the same gradient as 1 batch of 4, on the XLA device."""
    import torch_xla

    from utils.xla_runtime import init_xla_device

    device = init_xla_device()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (4, 16), generator=generator, dtype=torch.int32)
    labels = ids.clone()
    labels[0, :12] = -100  # unequal label counts per micro-batch: a mean of means would differ
    labels[3, :3] = -100
    positions = torch.arange(16, dtype=torch.int32).repeat(4, 1)
    full = {"input_ids": ids, "labels": labels, "position_ids": positions}

    def one_step(micro_batches):
        model = tiny_causal_lm("mistral")
        inject_lora(model, LoraConfig(r=4, alpha=8))
        with torch.no_grad():
            for _, m in lora_modules(model):
                m.lora_B.weight.normal_(generator=torch.Generator().manual_seed(1))
        model.to(device).train()
        params = lora_parameters(model)
        recorder = RecordGradients(params)
        moved = [{k: v.to(device) for k, v in b.items()} for b in micro_batches]
        results = train_step(model, recorder, moved, max_grad_norm=0.0)
        torch_xla.sync()
        return [g.cpu() for g in recorder.grads], {k: v.cpu() for k, v in results.items()}

    split = [{k: v[:2] for k, v in full.items()}, {k: v[2:] for k, v in full.items()}]
    grads_a, results_a = one_step(split)
    grads_b, results_b = one_step([full])
    assert any(g.abs().max() > 0 for g in grads_a)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(results_a["loss"], results_b["loss"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results_a["grad_norm"], results_b["grad_norm"], rtol=1e-5, atol=1e-6)
    assert results_a["tokens"].item() == results_b["tokens"].item() == (labels[:, 1:] != -100).sum().item()
    assert bool(results_a["applied"]) and bool(results_b["applied"])


def test_nothing_of_phase_1_is_alive_when_phase_2_starts(tiny_model_dir, data, tmp_path, monkeypatch):
    """With the garbage collector off, phase 1's model, optimizer, captured step and data loader
    are gone once phase 2 builds its own: on a chip that holds one copy of a 7B base, phase 2
    would otherwise need two. (Before: the Stepper's captured steps held its own methods, a
    cycle; the loader's thread held the phase data.)"""
    import gc
    import weakref

    from finetuning_pipeline import trainer

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
                ("captured gradients", p.stepper.gradients), ("captured update", p.stepper.update)]})
        return p

    monkeypatch.setattr(trainer, "start_phase", watched)
    gc.disable()
    try:
        assert main.main(["--config", str(config)]) == 0
    finally:
        gc.enable()
    assert len(phase1) == 6 and alive_at_phase2 == []
