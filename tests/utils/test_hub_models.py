"""model.path as a Hub id, read from a Hugging Face cache laid out as the Hub writes it
(models--ORG--NAME/refs/REVISION holding a commit, snapshots/COMMIT/ holding the files), with
HF_HUB_OFFLINE=1: nothing here reaches the network."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from trainer_helpers import prepare_demo_data, publish_to_hub_cache, write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.planning.phase_plan import load_architecture
from utils.hub_models import HubModelError, resolve_model

MODEL_ID = "tiny-org/tiny-mistral"
FIRST, SECOND = "a" * 40, "b" * 40  # two commits of the same repository


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_model_dir):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    publish_to_hub_cache(cache, MODEL_ID, FIRST, tiny_model_dir, "main")
    publish_to_hub_cache(cache, MODEL_ID, SECOND, tiny_model_dir, "v2")
    return cache


def test_a_hub_id_resolves_to_its_snapshot_and_commit(hub):
    source = resolve_model(MODEL_ID)
    assert (
        source.commit == FIRST
        and Path(source.local_dir) == hub / "models--tiny-org--tiny-mistral" / "snapshots" / FIRST
    )
    assert resolve_model(MODEL_ID, "v2").commit == SECOND  # a tag or branch
    assert resolve_model(MODEL_ID, SECOND).commit == SECOND  # a commit


def test_a_local_directory_wins_and_takes_no_revision(tiny_model_dir, hub):
    assert resolve_model(str(tiny_model_dir)).local_dir == str(tiny_model_dir)
    with pytest.raises(HubModelError, match="model.revision: 'v2' is set but model.path .* is a local directory"):
        resolve_model(str(tiny_model_dir), "v2")


def test_offline_and_not_in_the_cache_says_how_to_download(hub):
    with pytest.raises(HubModelError) as err:
        resolve_model("tiny-org/never-downloaded", "v1")
    message = str(err.value)
    assert f"it is not in {hub} and HF_HUB_OFFLINE is set" in message
    assert "hf download tiny-org/never-downloaded --revision v1 --include '*.json' '*.safetensors'" in message


def test_without_a_network_the_cache_is_read_at_once_not_after_half_a_minute_of_retries(hub, monkeypatch):
    """HF_HUB_OFFLINE unset, the Hub's host refuses connections (a closed local port): one probe
    says so, and the cache and the shipped configs are read as offline."""
    import socket

    import utils.hub_models as hub_models

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # free once the socket is closed: nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    hub_models.hub_reachable.cache_clear()
    try:
        assert hub_models.hub_unavailable() and not hub_models.hub_reachable()
        assert resolve_model(MODEL_ID).commit == FIRST
        with pytest.raises(HubModelError, match=f"it is not in {hub} and the Hub cannot be reached"):
            resolve_model("tiny-org/never-downloaded")
        config, source = load_architecture("google/gemma-3-270m")
        assert "model_configs" in str(source)
    finally:
        hub_models.hub_reachable.cache_clear()


def test_preflight_reads_the_architecture_from_the_cache_offline_else_the_shipped_copy(hub):
    config, source = load_architecture(MODEL_ID)
    assert config.model_type == "mistral" and source.parent.name == FIRST
    config, source = load_architecture("google/gemma-3-270m")  # not cached: our shipped copy
    assert config.model_type.startswith("gemma3") and "model_configs" in str(source)


@pytest.mark.heavy
def test_training_on_a_hub_id_records_the_commit_and_refuses_another_on_resume(hub, tiny_model_dir, tmp_path, capsys):
    data = prepare_demo_data(MODEL_ID, tmp_path / "data")  # prepare's --tokenizer takes the Hub id too
    out = tmp_path / "run"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out, model={"path": MODEL_ID},
                              train={"max_steps": 4}, checkpoint={"every": 2, "keep": 2}, eval={"every": 0})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    summary = json.loads((out / "phase1" / "summary.json").read_text())
    assert summary["resume_keys"]["model.path"] == MODEL_ID and summary["resume_keys"]["model.revision"] == FIRST
    adapter = json.loads((out / "phase1" / "adapter" / "adapter_config.json").read_text())
    assert adapter["base_model_name_or_path"] == MODEL_ID and adapter["revision"] == FIRST  # what PEFT loads

    publish_to_hub_cache(hub, MODEL_ID, SECOND, tiny_model_dir, "main")  # main moves on
    capsys.readouterr()
    assert main.main(["--config", str(config), "--phase", "1", "--resume", "auto"]) == 2
    assert "the base model's Hub revision is another commit" in capsys.readouterr().err

    # Interrupted before the end (no summary, no adapter): the step-2 checkpoint names its commit.
    shutil.rmtree(out / "phase1" / "adapter")
    (out / "phase1" / "summary.json").unlink()
    shutil.rmtree(out / "phase1" / "checkpoints" / "step_00000004")
    assert main.main(["--config", str(config), "--phase", "1", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"model.revision: '{FIRST}' -> '{SECOND}'" in err and f"set model.revision={FIRST}" in err
    assert main.main(["--config", str(config), "--phase", "1", "--resume", "auto", f"model.revision={FIRST}"]) == 0
    resumed = json.loads((out / "phase1" / "summary.json").read_text())
    assert resumed["resumed_from_step"] == 2 and resumed["resume_keys"]["model.revision"] == FIRST


def test_a_hub_id_that_is_not_cached_stops_before_training(hub, tiny_model_dir, tmp_path, capsys):
    data = {1: tmp_path / "none1", 2: tmp_path / "none2"}
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "run",
                              model={"path": "tiny-org/never-downloaded"})
    assert main.main(["--config", str(config), "--phase", "1"]) == 2
    err = capsys.readouterr().err
    assert "error: model.path: tiny-org/never-downloaded is not a local directory, and as a Hub id (revision main) " \
           "it is not in" in err and "hf download" in err
    assert not (tmp_path / "run" / "phase1").exists()
