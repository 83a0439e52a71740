"""train.scan_layers in the trainer: a run with its decoder layers scanned takes the steps of
the layer loop (losses, evaluations, adapters, both phases), also with activation
checkpointing (recomputed inside the loop); a checkpoint resumes with the other setting,
because it stores the optimizer's moments per layer either way; the summary says which ran.

A scanned run resumed scanned is bitwise the uninterrupted run (test_resume.py holds the layer
loop's runs to the same under SIGKILL/SIGTERM: their 2-layer model is not scanned by default).
The runs are float64: scanned and looped layers are equal in exact arithmetic, held to 1e-10
(tests/tolerances.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from tolerances import assert_equal_in_exact_arithmetic
from trainer_helpers import adapter_tensors, metric_records, write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.run.checkpointing import checkpoint_name, complete_checkpoints

RUN = {"train": {"max_steps": 8}, "checkpoint": {"every": 4, "keep": 2}, "eval": {"every": 4, "max_batches": 2},
       "logging": {"every": 1, "progress_bar": False, "tensorboard": False}, "lora": {"dropout": 0.1}}
VARIANTS = {"loop": ({"scan_layers": False}, {}), "scanned": ({"scan_layers": True}, {}),
            "recomputed": ({"scan_layers": True}, {"activation_checkpointing": True})}


def run_config(root, name, tiny_model_dir, data, out=None):
    train, model = VARIANTS[name]
    sections = {k: dict(v) for k, v in RUN.items()}
    sections["train"].update(train)
    sections["model"] = {"path": str(tiny_model_dir), "dtype": "float64", **model}
    return write_run_config(root / f"{name}.yaml", tiny_model_dir, data, out or root / name, **sections)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, data, tmp_path_factory):
    root = tmp_path_factory.mktemp("scan")
    for name in VARIANTS:
        assert main.main(["--config", str(run_config(root, name, tiny_model_dir, data))]) == 0
    return root


def assert_same_steps(out, reference, phase: int) -> None:
    for kind in ("train", "eval"):
        ours, theirs = metric_records(out, kind, phase), metric_records(reference, kind, phase)
        assert [r["step"] for r in ours] == [r["step"] for r in theirs] and ours
        assert_equal_in_exact_arithmetic([r["loss"] for r in ours], [r["loss"] for r in theirs], f"{kind} losses")
    ours, theirs = adapter_tensors(out, phase), adapter_tensors(reference, phase)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert_equal_in_exact_arithmetic(ours[key], theirs[key], key)


@pytest.mark.parametrize("phase", [1, 2])
@pytest.mark.parametrize("name", ["scanned", "recomputed"])
def test_scanned_layers_take_the_steps_of_the_layer_loop(runs, name, phase):
    assert_same_steps(runs / name, runs / "loop", phase)
    for variant in VARIANTS:
        summary = json.loads((runs / variant / f"phase{phase}" / "summary.json").read_text())
        assert summary["scanned_layers"] == (variant != "loop")


@pytest.mark.parametrize("saved, resumed", [("scanned", "scanned"), ("scanned", "loop"), ("loop", "scanned")])
def test_a_checkpoint_resumes_exactly_and_with_the_other_setting(runs, tiny_model_dir, data, tmp_path, saved,
                                                                 resumed):
    """Phase 1 stopped at step 4, finished with the same setting: bitwise the uninterrupted run;
    with the other setting: its steps within float64's bound (the moments crossed over: a
    stacked state loaded as per-layer, or the reverse, in the wrong order, would change steps 5-8)."""
    out = tmp_path / "out"
    shutil.copytree(runs / saved / "phase1" / "checkpoints", out / "phase1" / "checkpoints")
    for checkpoint in complete_checkpoints(out / "phase1" / "checkpoints"):
        if checkpoint.name != checkpoint_name(4):
            shutil.rmtree(checkpoint)
    config = run_config(tmp_path, resumed, tiny_model_dir, data, out=out)
    assert main.main(["--config", str(config), "--phase", "1", "--resume", "auto"]) == 0
    resumed_losses = [(r["step"], r["loss"]) for r in metric_records(out, "train", 1)]
    reference = [(r["step"], r["loss"]) for r in metric_records(runs / saved, "train", 1) if r["step"] > 4]
    assert [s for s, _ in resumed_losses][-4:] == [5, 6, 7, 8]
    ours, theirs = adapter_tensors(out), adapter_tensors(runs / saved)
    assert ours.keys() == theirs.keys()
    if saved == resumed:
        assert [loss for _, loss in resumed_losses][-4:] == [loss for _, loss in reference]
        assert all(torch.equal(ours[key], theirs[key]) for key in theirs)
        return
    assert_equal_in_exact_arithmetic([loss for _, loss in resumed_losses][-4:], [loss for _, loss in reference],
                                     "losses after the resume")
    for key in theirs:
        assert_equal_in_exact_arithmetic(ours[key], theirs[key], key)
