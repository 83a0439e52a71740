"""The resume plan (run/resume_plan.py): where each phase starts for --resume auto / never / DIR,
and which resumes and finished phases are refused, on output directories laid out by hand. The
runs that stop and resume for real are in tests/e2e/test_resume.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trainer_helpers import write_run_config

from finetuning_pipeline.errors import ConfigError
from finetuning_pipeline.run.checkpointing import resume_keys
from finetuning_pipeline.run.resume_plan import PhasePlan, check_resumable, plan_phases
from finetuning_pipeline.run_config import load_config


@pytest.fixture
def config(tiny_model_dir, data, tmp_path):
    return load_config(write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "out"))


def finished(config, phase: int, **changed) -> None:
    """phaseN/ as a finished phase leaves it: a summary recording the settings it was built on."""
    settings = {**resume_keys(config, phase), **changed}
    directory = Path(config.output_dir) / f"phase{phase}"
    directory.mkdir(parents=True)
    (directory / "summary.json").write_text(json.dumps({"phase": phase, "resume_keys": settings}))


def test_auto_on_an_empty_output_dir_starts_every_phase_fresh(config):
    assert plan_phases(config, [1, 2], "auto", force=False) == [PhasePlan(1, None), PhasePlan(2, None)]


def test_auto_skips_a_finished_phase_and_says_what_changed_since(config, capsys):
    finished(config, 1, **{"train.lr": 0.5})
    assert plan_phases(config, [1, 2], "auto", force=False) == [PhasePlan(2, None)]
    out = capsys.readouterr().out
    assert "phase 1: already finished" in out and "train.lr: 0.5 -> 0.01" in out


def test_auto_refuses_a_finished_phase_whose_data_changed(config):
    finished(config, 1, **{"phase1.data.content": "another digest"})
    with pytest.raises(ConfigError, match="finished on other inputs: .* was prepared again from other inputs"):
        plan_phases(config, [1], "auto", force=False)


def test_never_refuses_existing_outputs_without_force_and_what_no_run_wrote_with_it(config):
    finished(config, 1)
    with pytest.raises(ConfigError, match="phase1 already exists; pass --force"):
        plan_phases(config, [1, 2], "never", force=False)
    assert plan_phases(config, [1, 2], "never", force=True) == [PhasePlan(1, None, replace=True),
                                                               PhasePlan(2, None, replace=False)]
    notes = Path(config.output_dir) / "phase1" / "notes.txt"
    notes.write_text("mine")
    with pytest.raises(ConfigError, match="holds notes.txt, which no run wrote"):
        plan_phases(config, [1], "never", force=True)
    assert notes.read_text() == "mine"


def test_a_resume_dir_that_is_not_a_complete_checkpoint_is_refused(config, tmp_path):
    partial = tmp_path / "step_00000004"
    partial.mkdir()
    with pytest.raises(ConfigError, match=r"step_00000004: not a checkpoint \(a checkpoint is a directory"):
        plan_phases(config, [1, 2], str(partial), force=False)
    (partial / "trainer_state.json").write_text("{}")  # written, but not its COMPLETE marker
    with pytest.raises(ConfigError, match="incomplete checkpoint .* it was interrupted while saving"):
        plan_phases(config, [1, 2], str(partial), force=False)


def checkpoint(path: Path, config, phase: int = 1, **changed) -> PhasePlan:
    """What check_resumable reads of a checkpoint: the settings it was saved under."""
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"resume_keys": {**resume_keys(config, phase), **changed}}))
    return PhasePlan(phase, path)


def test_a_resume_under_other_settings_is_refused_naming_each(config, tmp_path):
    plan = checkpoint(tmp_path / "ckpt", config, **{"train.seed": 7, "lora.r": 4})
    with pytest.raises(ConfigError, match=r"other settings \(lora.r: 4 -> 8, train.seed: 7 -> 0\)"):
        check_resumable(config, [plan])


def test_checkpoints_and_summaries_written_before_resume_keys_had_one_name_are_compared_too(config, tmp_path):
    """A checkpoint's keys were "exactness", a summary's "settings": still read."""
    path = tmp_path / "old-ckpt"
    path.mkdir()
    (path / "trainer_state.json").write_text(json.dumps({"exactness": {**resume_keys(config, 1), "lora.r": 4}}))
    with pytest.raises(ConfigError, match=r"other settings \(lora.r: 4 -> 8\)"):
        check_resumable(config, [PhasePlan(1, path)])
    directory = Path(config.output_dir) / "phase1"
    directory.mkdir(parents=True)
    old_data = {**resume_keys(config, 1), "phase1.data.content": "sha256:other"}
    (directory / "summary.json").write_text(json.dumps({"phase": 1, "settings": old_data}))
    with pytest.raises(ConfigError, match="finished on other inputs"):
        plan_phases(config, [1], "auto", force=False)


def test_a_resume_with_another_set_of_adapters_is_refused_naming_the_set_not_their_order(config, tmp_path):
    """Adapters removed, added or renamed: refused by name, with or without --accept-changes; a
    checkpoint does not hold the other set's state. Listed in another order: resumed (each
    adapter's state is kept by its name)."""
    other = checkpoint(tmp_path / "ckpt", config, **{"phase1.adapters": ["chat", "sql"]})
    with pytest.raises(ConfigError, match=r"phase1.adapters: \['chat', 'sql'\] -> \['default'\].*trains another set "
                                          r"of adapters now: list the checkpoint's \['chat', 'sql'\] again"):
        check_resumable(config, [other])
    with pytest.raises(ConfigError, match=r"cannot continue under another phase1.adapters"):
        check_resumable(config, [other], accept_changes=True)
    assert resume_keys(config, 1)["phase1.adapters"] == ["default"]


def test_accept_changes_takes_optimisation_settings_only(config, tmp_path, capsys):
    plan = checkpoint(tmp_path / "ckpt", config, **{"train.lr": 0.5})
    check_resumable(config, [plan], accept_changes=True)
    assert plan.accepted_changes == {"train.lr": [0.5, 0.01]}
    assert "no longer the one an uninterrupted run would give" in capsys.readouterr().out
    fixed = checkpoint(tmp_path / "other", config, **{"lora.r": 4})
    with pytest.raises(ConfigError, match=r"cannot continue under another lora.r \(4 -> 8\)"):
        check_resumable(config, [fixed], accept_changes=True)


@pytest.fixture
def curriculum(tiny_model_dir, data, tmp_path):
    """Four phases: 2 continues phase 1's adapter, 3 merges phase 2's into the base, 4 continues 3's."""
    return load_config(write_run_config(tmp_path / "four.yaml", tiny_model_dir, data, tmp_path / "out",
                                        phase3={"data": str(data[1]), "init": "merge"},
                                        phase4={"data": str(data[2]), "init": "continue"}))


def test_a_finished_phase_is_redone_when_an_earlier_adapter_it_builds_on_changed(curriculum):
    for phase in (1, 2, 3, 4):
        finished(curriculum, phase)
    assert plan_phases(curriculum, [1, 2, 3, 4], "auto", force=False) == []
    shutil.rmtree(Path(curriculum.output_dir) / "phase3")
    finished(curriculum, 3, **{"phase2.adapter": "phase 2 as it was trained before"})
    with pytest.raises(ConfigError, match="phase 3 .* finished on other inputs: phase 2 was trained again since "
                                          "phase 3 was built on its adapter"):
        plan_phases(curriculum, [1, 2, 3, 4], "auto", force=False)
    assert "phase2.adapter" in resume_keys(curriculum, 3) and "phase1.adapter" not in resume_keys(curriculum, 3)
    # phase 4 continues phase 3's adapter, which sits on the base with phase 2's merged in
    assert [k for k in resume_keys(curriculum, 4) if k.endswith(".adapter")] == ["phase2.adapter", "phase3.adapter"]


def test_a_later_phases_resume_names_the_earlier_phase_trained_again_and_takes_its_own_lr(curriculum, tmp_path):
    plan = checkpoint(tmp_path / "ckpt", curriculum, 4, **{"phase3.adapter": "another digest"})
    with pytest.raises(ConfigError, match="phase 3 was trained again since this phase-4 checkpoint was built on"):
        check_resumable(curriculum, [plan])
    tuned = checkpoint(tmp_path / "tuned", curriculum, 4, **{"phase4.lr": 0.5, "phase4.max_steps": 30})
    check_resumable(curriculum, [tuned], accept_changes=True)
    assert tuned.accepted_changes == {"phase4.lr": [0.5, None], "phase4.max_steps": [30, None]}
    moved = checkpoint(tmp_path / "moved", curriculum, 4, **{"phase4.data.content": "other data"})
    with pytest.raises(ConfigError, match=r"cannot continue under another phase4.data.content"):
        check_resumable(curriculum, [moved], accept_changes=True)
