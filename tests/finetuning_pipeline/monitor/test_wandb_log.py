"""Weights & Biases in its offline mode (nothing leaves the machine): a phase's run gets the
config, the records of metrics.jsonl and the summary; a resumed phase continues the same run;
without the wandb package, the run stops before the device with the install command."""

from __future__ import annotations

import json
import sys

import pytest
from trainer_helpers import write_run_config

from finetuning_pipeline import main
from finetuning_pipeline.monitor.metrics_log import read_metrics


def offline_run(phase_dir):
    [run] = sorted((phase_dir / "wandb").glob("offline-run-*"))
    return run


def wandb_records(path):
    """The protobuf records of an offline run's .wandb file: W&B's framing, the LevelDB log
    format (a 7-byte file header, 32 KiB blocks, each chunk a 7-byte header of crc32, length
    and type: full, first, middle or last), which `wandb sync` reads; W&B ships no reader."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        length, kind = int.from_bytes(data[offset + 4:offset + 6], "little"), data[offset + 6]
        chunk, offset = data[offset + 7:offset + 7 + length], offset + 7 + length
        if kind == 0 and length == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def logged(records):
    """{kind: [...]}: history rows as {key: value} (with "_step"), config and summary items."""
    found = {"history": [], "config": {}, "summary": {}}
    for record in records:
        which = record.WhichOneof("record_type")
        if which == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            found["history"].append(row)
        elif which == "config":
            found["config"].update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif which == "summary":
            found["summary"].update({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                     for item in record.summary.update})
        elif which == "run":
            found["config"].update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    return found


@pytest.mark.heavy
def test_a_phase_logs_its_config_records_and_summary_to_an_offline_wandb_run(tiny_model_dir, data, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out, train={"max_steps": 4},
                              logging={"every": 1, "wandb": {"project": "tpu-lora-tests", "mode": "offline",
                                                             "name": "wb"}},
                              checkpoint={"every": 2}, eval={"every": 2})
    assert main.main(["--config", str(config), "--phase", "1"]) == 0
    phase_dir = out / "phase1"
    run = offline_run(phase_dir)
    run_id = (phase_dir / "wandb_run_id").read_text().strip()
    assert run.name.endswith(run_id) and (run / f"run-{run_id}.wandb").stat().st_size > 0

    found = logged(wandb_records(run / f"run-{run_id}.wandb"))
    assert found["config"]["lora"]["r"] == 8 and found["config"]["phase"] == 1
    records = read_metrics(phase_dir / "metrics.jsonl")
    for record in records:  # every record of metrics.jsonl, at its step
        [row] = [row for row in found["history"] if row["_step"] == record["step"]
                 and f"{record['kind']}/loss" in row]
        for key, value in record.items():
            if key not in ("kind", "step") and value is not None:
                assert row[f"{record['kind']}/{key}"] == value, (record, key)
    ours = json.loads((phase_dir / "summary.json").read_text())
    assert found["summary"]["eval_loss_after"] == ours["eval_loss_after"] and found["summary"]["steps"] == 4


def test_a_resumed_phase_continues_its_wandb_run(tiny_model_dir, data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, out, train={"max_steps": 4},
                              logging={"wandb": {"project": "tpu-lora-tests", "mode": "offline"}},
                              checkpoint={"every": 2}, eval={"every": 0})
    assert main.main(["--config", str(config), "--phase", "1", "train.max_steps=2"]) == 0
    run_id = (out / "phase1" / "wandb_run_id").read_text().strip()
    assert main.main(["--config", str(config), "--phase", "1", "--resume", "auto", "--accept-changes"]) == 0
    assert (out / "phase1" / "wandb_run_id").read_text().strip() == run_id
    assert all(run.name.endswith(run_id) for run in (out / "phase1" / "wandb").glob("offline-run-*"))


def test_without_the_wandb_package_the_run_stops_before_the_device(tiny_model_dir, data, tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "run",
                              logging={"wandb": {"project": "p"}})
    assert main.main(["--config", str(config), "--phase", "1"]) == 2
    err = capsys.readouterr().err
    assert "logging.wandb.project is set but the wandb package is not installed: pip install 'tpu-lora[wandb]'" in err
    assert not (tmp_path / "run" / "phase1").exists()


def test_a_wandb_mode_that_does_not_exist_is_named(tiny_model_dir, data, tmp_path, capsys):
    config = write_run_config(tmp_path / "run.yaml", tiny_model_dir, data, tmp_path / "run",
                              logging={"wandb": {"project": "p", "mode": "sometimes"}})
    assert main.main(["--config", str(config), "--phase", "1"]) == 2
    assert "logging.wandb.mode must be online, offline or disabled, got 'sometimes'" in capsys.readouterr().err
